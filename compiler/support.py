"""What a target can build: a recipe's options checked against the target registry's figures, each refusal at the
option's place in the recipe. The one module that reads both: the options (compiler/options.py) and the targets
(compiler/targets.py) know nothing of each other's checks."""
from __future__ import annotations

from kiln.compiler.options import RecipeOptions
from kiln.compiler.targets import TARGETS, Target, TargetError
from kiln.dsl.errors import SourceError

# speculative methods that need no draft head in the model (any k): n-gram prompt lookup, a separate draft model,
# an EAGLE head; the last two read a checkpoint of their own (`speculative.draft`)
MODEL_FREE_METHODS = ("ngram", "draft", "eagle")
CHECKPOINT_METHODS = ("draft", "eagle")

# Recipe sections kiln parses but cannot build on any target yet: an error at the section, never ignored.
_NOT_YET = {
}


def check_supported(target: Target, options: RecipeOptions) -> None:
    """Refuses, at the option's place in the recipe, what `target` cannot build (or kiln not yet).
    `kiln compile` runs it with and without -o: a plan is made only for what could be built."""
    def refuse(message: str, key: str) -> None:
        raise TargetError(message) if options.loc(key) is None else SourceError(message, options.loc(key))

    if options.dtype not in target.dtypes:
        refuse(f"target {target.name} has no {options.dtype} kernels (dtypes: {', '.join(sorted(target.dtypes))})",
               "dtype")
    for section, what in _NOT_YET.items():
        if section in options.set_sections:
            refuse(what, section)
    dis = options.disaggregate
    if dis.decode > 1:
        refuse(f"disaggregate.decode = {dis.decode}: more than one decode core behind one router is not "
               "implemented yet (`kiln serve ART --disaggregate --replicas N` runs N prefill + decode replicas)",
               "disaggregate.decode")
    if options.kv_cache.offload is not None and options.scheduler.prefix_cache == "none":
        refuse("kv_cache.offload keeps the blocks the prefix cache evicts: it needs scheduler.prefix_cache = "
               "radix", "kv_cache.offload")
    if options.kv_cache.offload is not None and options.parallel.dp > 1:
        # tensor parallelism is served (every rank offloads its slice of the same blocks, runtime/worker/distributed/
        # kv_offload.py); under data-parallel attention a block's KV is on one rank, its sequence's
        refuse(f"kv_cache.offload with data-parallel attention (parallel.dp = {options.parallel.dp}) is not "
               "implemented yet: each block's KV is on the one rank running its sequence, so a restore would "
               "have to move it to the rank the returning sequence is placed on (tp meshes are served)",
               "kv_cache.offload")
    _supports_mesh(target, options, refuse)
    if options.task == "embed":
        par = options.parallel
        if max(par.tp, par.dp, par.ep) > 1:
            refuse("task = embed on a parallel mesh is not implemented yet (the pooled hidden rows have no placement "
                   "rule): compile it for one device", "task")
        if "speculative" in options.set_sections or "lora" in options.set_sections:
            refuse("task = embed serves no speculative decoding or LoRA adapters (an embedding model generates "
                   "nothing)", "task")
    q = options.quantize
    if q.weights is not None:
        if q.weights.kind not in target.weight_schemes:
            refuse(f"quantize.weights: target {target.name} has no {q.weights.kind} kernels", "quantize.weights")
    if q.kv_cache is not None and "fp8" not in target.kv_schemes:
        refuse(f"quantize.kv_cache: target {target.name} has no fp8 KV cache", "quantize.kv_cache")
    spec = options.speculative
    if (spec.draft is not None) != (spec.method in CHECKPOINT_METHODS):
        refuse("a separate draft model is `speculative { method = draft; draft = \"hf:DIR\" }`, the checkpoint "
               "of a smaller model sharing the tokenizer, an EAGLE head `method = eagle; draft = \"hf:DIR\"` "
               "(method = ngram needs no model, method = mtp uses the model's own MTP head)",
               "speculative.draft" if spec.draft is not None else "speculative.method")
    if spec.method is not None and spec.method not in MODEL_FREE_METHODS:
        if spec.method not in target.draft_methods:
            refuse(f"speculative decoding method {spec.method!r} is not implemented yet (kiln builds: "
                   f"{', '.join(MODEL_FREE_METHODS)}, prompt lookup; {', '.join(target.draft_methods)}, a draft "
                   "head compiled into the model)", "speculative.method")
    if "lora" in options.set_sections:
        _lora_supported(options, refuse)
    # n-gram and draft-model drafts are tokens that rank 0 schedules as verify rows, on any mesh; a draft head
    # reads the target's hidden states, which data-parallel attention leaves on each sequence's rank
    if options.parallel.dp > 1 and spec.method in target.draft_methods:
        refuse(f"speculative.method = {spec.method} with data-parallel attention (parallel.dp > 1) is not "
               "implemented yet: a draft head reads the target's hidden states, which stay on their ranks "
               "(ngram and draft models work)", "speculative.method")
    if "cuda_graphs" in options.set_sections:
        if not target.cuda_graphs:
            capture = ", ".join(t.name for t in TARGETS.values() if t.cuda_graphs)
            refuse(f"cuda_graphs needs a GPU target ({capture}); the {target.name} target runs decode eagerly",
                   "cuda_graphs")
        try:
            options.cuda_graphs.buckets(options.scheduler.max_seqs)
        except ValueError as e:
            refuse(f"cuda_graphs.batch_sizes: {e}", "cuda_graphs.batch_sizes")


def _supports_mesh(target: Target, options: RecipeOptions, refuse) -> None:
    """`parallel { tp; dp; ep; pp }`: tp x dp ranks up to max_devices, ep dividing them; pipeline parallelism
    and tensor parallelism inside data-parallel attention groups are not built."""
    par = options.parallel
    if par.pp > 1:
        refuse(f"parallel.pp = {par.pp}: pipeline parallelism is not implemented (kiln places layers on one "
               "rank each step; it builds tensor (tp), expert (ep) and data-parallel attention (dp) meshes)",
               "parallel.pp")
    if par.tp > 1 and par.dp > 1:
        refuse(f"parallel: tp = {par.tp} with dp = {par.dp} (tensor-parallel attention inside data-parallel "
               "groups) is not implemented yet; use tp or dp (MLPs are sharded over all tp x dp ranks)",
               "parallel.dp")
    if par.dense == "replicated" and par.dp == 1:
        refuse("parallel.dense = replicated needs data-parallel attention (dp > 1): with tensor-parallel "
               "attention every rank holds a slice of each row, not rows of its own", "parallel.dense")
    if par.world > target.max_devices:
        key = "parallel.tp" if par.tp > 1 else "parallel.dp"
        refuse(f"parallel: {par.world} ranks (tp x dp) exceed target {target.name}'s {target.max_devices} devices",
               key)
    if par.world % par.ep:
        refuse(f"parallel.ep = {par.ep} must divide the {par.world} ranks (tp x dp = {par.tp} x {par.dp}): "
               "experts are placed on ep groups of world / ep ranks", "parallel.ep")

def _lora_supported(options: RecipeOptions, refuse) -> None:
    """What LoRA serving composes with: prefix caching does (block keys include the adapter); speculative
    decoding by n-gram lookup or a draft model does (the verify rows are the sequence's, with its adapter; the
    drafts are proposals, so outputs stay exact); quantized base weights do (the branch reads the GEMM's input
    and adds to its output); tensor parallelism does (each rank holds its slice of the adapter slots: B's output
    rows of a column-parallel linear, A's input columns of a row-parallel one, whose partial branch the base's
    all_reduce sums). A draft head (mtp), data-parallel attention and expert parallelism are refused, at the
    section that asks."""
    method = options.speculative.method
    if method is not None and method not in MODEL_FREE_METHODS:
        refuse(f"LoRA with speculative method = {method} is not supported: the draft head reads the target's "
               "hidden states, which an adapter shifts away from the base model's it was trained on, and has no "
               "adapter of its own; use method = ngram or method = draft (exact with adapters)",
               "speculative.method")
    par = options.parallel
    if par.dp > 1:
        refuse(f"LoRA with parallel.dp = {par.dp} is not supported yet: data-parallel attention runs each rank's own "
               "sequences through attention but every rank's rows through the MLPs, and the adapter rows of a step "
               "are planned for one batch (tp composes with LoRA)", "parallel.dp")
    if par.ep > 1:
        refuse(f"LoRA with parallel.ep = {par.ep} is not supported yet: experts are not adapted, and expert-parallel "
               "groups would need adapter rows per group (tp composes with LoRA)", "parallel.ep")
    if options.lora.max_rank > 256:
        refuse(f"lora.max_rank = {options.lora.max_rank}: at most 256", "lora.max_rank")
