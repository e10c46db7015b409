"""A speculative proposer's own memory is planned with the target's KV pool: under a byte budget the target's
pool, the proposer's pool and the proposer's weights, measured from the tensors the engine allocated, fit the
budget together (before, the proposer's pool and weights came on top of a pool that took the whole budget);
an explicit block count stays the target's. A full EAGLE head pool drafts nothing for the sequences it cannot
hold and the outputs stay exactly greedy."""
from __future__ import annotations

import pytest
from kiln.runtime.core.kv_cache import BlockManager
from spec_testlib import assert_all_blocks_free, greedy, run, tokens
from test_spec_eagle import save_eagle_head
from test_spec_eagle3 import save_eagle3_head


@pytest.fixture(scope="module")
def target(compile_hf):
    ckpt, art, _ = compile_hf("llama")
    return ckpt, art


@pytest.fixture(scope="module")
def drafts(target, compile_hf, tmp_path_factory):
    return {"eagle": save_eagle_head(tmp_path_factory.mktemp("eagle_head") / "h", target[0]),
            "eagle3": save_eagle3_head(tmp_path_factory.mktemp("eagle3_head") / "h", target[0]),
            "draft": compile_hf("llama", seed=7, num_hidden_layers=1)[1]}


def _nbytes(tensors) -> int:
    return sum(t.nbytes for t in tensors)  # a tensor's, or a TVM-packed weight's panels


def _target_pool(engine) -> int:
    return _nbytes(engine.runner.kv_caches)


def _proposer_memory(engine) -> int:
    """What the proposer allocated on the device: its KV pool and its weights."""
    p = engine.speculator.proposer
    if engine.speculative.method == "eagle":
        ids = getattr(p.head, "target_ids", None)  # an EAGLE-3 head's draft-to-target id table
        return _nbytes([p.kv_cache]) + _nbytes(p.head.w.values()) + (0 if ids is None else ids.nbytes)
    return _nbytes(p.runner.kv_caches) + _nbytes(_weights(p.runner.model))


def _weights(model):
    """The generated model's weights: its tensor attributes and lists of them (one per layer), not its rope
    cache (a table of cos/sin, neither KV nor a weight)."""
    seen = {}
    for name, value in vars(model).items():
        for t in value if isinstance(value, list | tuple) else [value]:
            if hasattr(t, "nbytes") and hasattr(t, "dtype") and "rope" not in name:
                seen[id(t)] = t
    return list(seen.values())


@pytest.mark.parametrize("head", ["eagle", "eagle3", "draft"])
def test_target_pool_and_proposer_fit_the_byte_budget_together(target, drafts, head):
    method = "eagle" if head == "eagle3" else head
    budget = 3 << 20
    alone, _, engine0 = run(target[1], [greedy(8)] * 4, num_kv_blocks=None, kv_cache_bytes=budget, speculative=None)
    bytes_per_block = _target_pool(engine0) // engine0.runner.num_blocks
    assert _target_pool(engine0) > budget - bytes_per_block  # alone, the target's pool takes the whole budget
    outs, _, engine = run(target[1], [greedy(8)] * 4, num_kv_blocks=None, kv_cache_bytes=budget, speculative=method,
                          num_speculative_tokens=2, speculative_model=str(drafts[head]))
    assert tokens(outs) == tokens(alone)
    used = _target_pool(engine) + _proposer_memory(engine)
    assert used <= budget, (used, budget)
    # and not wasteful: less than one target block and its share of the proposer's pool is left over
    assert budget - used < 3 * bytes_per_block, (budget - used, bytes_per_block)
    assert engine.runner.num_blocks < engine0.runner.num_blocks
    assert engine.runner.memory_plan["proposer_bytes"] > 0
    assert_all_blocks_free(engine)


def test_an_explicit_block_count_is_the_targets(target, drafts):
    _, _, engine = run(target[1], [greedy(4)] * 4, num_kv_blocks=40, speculative="eagle", num_speculative_tokens=2,
                       speculative_model=str(drafts["eagle"]))
    assert engine.runner.num_blocks == 40


def test_a_full_head_pool_drafts_nothing_for_the_sequences_it_cannot_hold(target, drafts):
    params = [greedy(m) for m in (24, 7, 24, 13)]
    plain, _, _ = run(target[1], params, speculative=None)

    from spec_testlib import prompts

    longest = max(len(p) for p in prompts()) + 24 + 2
    allocated = []

    def shrink_head_pool(engine):  # room for one sequence at a time
        proposer = engine.speculator.proposer
        bs = proposer.block_manager.block_size
        pool = proposer.block_manager = BlockManager(-(-longest // bs) + 1, bs)
        allocate = pool.allocate_slots
        pool.allocate_slots = lambda *a, **kw: allocated.append(allocate(*a, **kw)) or allocated[-1]

    got, _, engine = run(target[1], params, before=shrink_head_pool, speculative="eagle", num_speculative_tokens=2,
                         speculative_model=str(drafts["eagle"]))
    proposer = engine.speculator.proposer
    assert tokens(got) == tokens(plain)
    assert True in allocated and False in allocated  # some sequences got room for their drafts, some did not
    assert engine.stats()["spec_num_draft_tokens"] > 0
    assert_all_blocks_free(engine)
    from kiln.runtime.core.batch import ScheduledBatch
    from kiln.runtime.core.speculative import Launched

    proposer.propose(ScheduledBatch(), Launched(sampled=None, new_tokens=[], draft_input=None, starts=[]), [], [])
    assert proposer.block_manager.num_free_blocks == proposer.block_manager.num_blocks  # nothing leaked


def test_the_compile_report_says_what_its_pool_prediction_leaves_out(target, drafts):
    import kiln

    recipe = target[1].parent / "recipe.dsl"
    with_head = recipe.with_name("recipe_eagle.dsl")
    section = f'  speculative {{ method = eagle; tokens = 2; draft = "hf:{drafts["eagle"]}" }}\n  serve '
    with_head.write_text(recipe.read_text().replace("  serve ", section, 1))
    note = "eagle proposer's own KV pool and weights share this budget"
    assert note in kiln.compile(with_head, None, progress=False).report
    assert "proposer" not in kiln.compile(recipe, None, progress=False).report
