"""Lets a vocab-parallel LM head send each row's top candidates instead of every logit, when that is all a step
samples from."""
from __future__ import annotations

from kiln.compiler import Pass, PassContext, Program, register_pass
from kiln.compiler.rewrite import Builder, Match, P, Rewrite, apply_rewrites


def _gathers_logits(m: Match) -> bool:
    return m.node("g").attrs["dim"] == m.node("l").out.rank - 1


def _candidates(m: Match, b: Builder) -> str:
    gather = m.node("g")
    return b.add("gather_logits", (m["l"],), hint=m["g"], dim=gather.attrs["dim"],
                 placement=gather.attrs["placement"])


REWRITES = (
    # g = all_gather(l = logits(h, w), dim=1) -> g = gather_logits(l)
    Rewrite("gather_logits", P("all_gather", P("logits", name="l"), name="g"),
            replace=_candidates, extra_check=_gathers_logits),
)


@register_pass("vocab_parallel_sampling", requires=("place_parallel",),
               before=("dead_code_elimination", "kernel_selection"))
class VocabParallelSampling(Pass):
    """Requires: a placed program (place_parallel). Guarantees: the all_gather of every vocab-parallel LM head's
    logits (sharded on the vocabulary) is a `gather_logits`: in a step whose rows are all sampled greedily or
    with top-k (no logprobs, penalties, logit bias or constraints: the runtime sets `batch.logit_candidates`),
    each rank sends only its k best (value, index) pairs per row instead of its slice of the vocabulary, and
    the row's other columns are -inf (the sampler picks the same tokens: greedy takes the max, top-k keeps the
    same k, the same noise is drawn); otherwise it gathers every logit as before. Nothing changes on a single
    device or under data-parallel attention (whose logits rows are not vocab-sharded)."""

    def run(self, program: Program, ctx: PassContext) -> Program:
        return apply_rewrites(program, REWRITES, ctx)
