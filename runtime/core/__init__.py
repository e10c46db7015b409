"""The engine core (`python -m kiln.runtime.core.process`, or in-process under LLM / LLMEngine): the step loop,
scheduler, paged KV and prefix cache, sampler, structured output, speculative proposers, the KV offload tier and
the block-lease ledger. It drives the model through a worker (worker/) and never imports the API (api/)."""
