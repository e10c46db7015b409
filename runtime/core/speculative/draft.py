"""The `draft` proposer: a second, smaller artifact (a model sharing the target's tokenizer) drafts k tokens
greedily, with its own KV pool and block tables."""
from __future__ import annotations

import json
from typing import Any

import torch

from ...config import SpeculativeConfig
from ...errors import ArtifactError
from ...worker.model_runner import ModelRunner
from ..batch import ScheduledBatch, cdiv
from ..kv_cache import BlockManager
from ..sequence import Sequence
from . import Launched, PoolShare, Proposer, SeqStates, draft_path, shadow_sequence


class DraftModelProposer(Proposer):
    """The draft model follows each target sequence with a shadow `Sequence` of its own (same tokens, its own
    `num_computed_tokens` and block table in the draft's BlockManager), so the draft's ModelRunner plans its
    batches exactly as the target's does.

    A step drafts in `k` forwards of the draft model: one over every token the draft has not computed yet (its
    prompt the first time, then the tokens the target accepted and its own next token), whose last row gives
    draft 1, then `k - 1` single-token decodes of the drafts themselves. Afterwards a shadow counts only the
    sequence's real tokens as computed: the drafts' KV slots are overwritten by the next step's catch-up, so
    rejected drafts need no rollback. A sequence the draft pool has no room for gets no drafts this step.
    """

    @classmethod
    def pool_share(cls, config: SpeculativeConfig, artifact: Any) -> PoolShare:
        """Its KV per target token slot, plus k + a block of slots per sequence, and its weights: from its
        manifest, before it is loaded. Nothing when there is no readable manifest (the load will say why)."""
        try:
            manifest = json.loads((draft_path(config, artifact) / "manifest.json").read_text(encoding="utf-8"))
            per_token, block = int(manifest["kv_cache"]["bytes_per_token"]), int(manifest["kv_cache"]["block_size"])
            weights = int(manifest["weights"]["total_bytes"])
        except (OSError, ValueError, KeyError, TypeError):
            return PoolShare()
        seqs = artifact.scheduler_config.max_seqs * (config.num_tokens + block)
        return PoolShare(per_block=artifact.kv_cache_config.block_size * per_token,
                         fixed=weights + seqs * per_token)

    def __init__(self, config: SpeculativeConfig, runner: Any, artifact: Any) -> None:
        from ...artifact import load_artifact

        path = draft_path(config, artifact)
        draft = load_artifact(path, artifact.device, load_tokenizer=False)
        if draft.world_size > 1:
            raise ArtifactError(f"speculative draft model {path}: a parallel artifact; a draft runs on one device")
        mine, theirs = (a.path / "tokenizer" / "tokenizer.json" for a in (artifact, draft))
        if draft.model_config.vocab_size != artifact.model_config.vocab_size or (
                mine.is_file() and theirs.is_file() and mine.read_bytes() != theirs.read_bytes()):
            raise ArtifactError(f"speculative draft model {path}: its vocabulary ({draft.model_config.vocab_size} "
                                f"tokens) or tokenizer differs from the target's ({artifact.model_config.vocab_size} "
                                "tokens); a draft model must share the target's tokenizer")
        target_kv, kv = artifact.kv_cache_config, draft.kv_cache_config
        # as many token slots as the target's pool, plus k - 1 draft positions per sequence it may run
        tokens = runner.num_blocks * target_kv.block_size
        tokens += artifact.scheduler_config.max_seqs * (config.num_tokens + kv.block_size)
        num_blocks = cdiv(tokens, kv.block_size)
        self.runner = ModelRunner(draft.model, kv, num_blocks, draft.device)
        self.block_manager = BlockManager(num_blocks, kv.block_size)
        self.max_model_len = draft.model_config.max_model_len
        self.shadows: SeqStates[Sequence] = SeqStates(shadow_sequence, self.block_manager.free)

    def propose(self, batch: ScheduledBatch, launched: Launched, wanting: list[int],
                limits: list[int]) -> list[list[int]]:
        self.shadows.prune()
        out: list[list[int]] = [[] for _ in wanting]
        shadows, ks, slots = [], [], []
        for j, (i, k) in enumerate(zip(wanting, limits, strict=True)):
            seq = batch.seqs[i]
            k = min(k, self.max_model_len - seq.num_tokens)
            shadow = self.shadows.get(seq)
            shadow.token_ids = list(seq.token_ids)
            shadow.num_computed_tokens = min(shadow.num_computed_tokens, seq.num_tokens - 1)
            n = seq.num_tokens - shadow.num_computed_tokens
            if k > 0 and self.block_manager.allocate_slots(shadow, n + k - 1):
                shadows.append(shadow)
                ks.append(k)
                slots.append(j)
        if not shadows:
            return out
        with torch.inference_mode():
            catch_up = [s.num_tokens - s.num_computed_tokens for s in shadows]
            self._forward(ScheduledBatch(seqs=shadows, num_new_tokens=catch_up), shadows)
            for round_ in range(1, max(ks)):
                live = [s for s, k in zip(shadows, ks, strict=True) if k > round_]
                self._forward(ScheduledBatch(seqs=live, num_new_tokens=[1] * len(live),
                                                      num_decodes=len(live)), live)
        for shadow, j, k in zip(shadows, slots, ks, strict=True):
            real = batch.seqs[wanting[j]].num_tokens
            out[j] = shadow.token_ids[real:real + k]
            shadow.num_computed_tokens = real  # the drafts' slots: rewritten by the next catch-up
        return out

    def _forward(self, batch: ScheduledBatch, seqs: list[Sequence]) -> None:
        """One draft forward: each shadow's greedy next token, appended to it (its input computed)."""
        logits, layout = self.runner.execute(batch)
        tokens = logits.argmax(dim=-1).tolist()
        for seq, n, row in zip(seqs, batch.num_new_tokens, layout.sample_rows, strict=True):
            seq.num_computed_tokens += n
            seq.token_ids.append(tokens[row])
