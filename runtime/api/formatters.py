"""The formatter of each endpoint over the Formatter base (streaming.py): /v1/completions (echo, logprobs),
/v1/chat/completions (reasoning, content and tool calls split by the request's parsers) and /v1/responses (its
event sequence, and the stored response)."""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response

from ..errors import KilnRuntimeError
from ..outputs import PositionLogprobs
from .async_engine import RequestGroup
from .chat_plan import ChoiceParser, RequestPlan
from .protocol import APIError, ChatCompletionRequest
from .responses import (
    ResponsesRequest,
    final_status,
    message_item,
    output_text_part,
    reasoning_item,
    response_object,
    usage_object,
)
from .streaming import Formatter, FormatterServer, finite_logprob, json_encode, ranked_logprobs, token_str


class CompletionFormatter(Formatter):
    """`echo` puts the prompt's text before each choice's text, and with `logprobs` its tokens before the
    generated ones: the first prompt token's logprob and top logprobs are null (it has no context), offsets
    count from the start of the echoed text. `max_tokens: 0` (with echo) shows the prompt alone: the one token
    the engine generated for it is dropped. Streamed, a choice's first chunk carries the echo; with logprobs it
    waits until the prompt's logprobs are all in (they arrive with the prefill, chunk by chunk)."""

    object_name = chunk_object_name = "text_completion"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.text_offsets = [0] * self.num_choices
        self.echo_only = self.req.max_tokens == 0
        self.echo_pending = [self.req.echo] * self.num_choices  # streaming: the echo is still to be sent
        self.held: list[list[Any]] = [[] for _ in range(self.num_choices)]

    # Echo --------------------------------------------------------------------------------------------------
    def prompt_text(self, prompt: int) -> str:
        p = self.group.inputs[prompt]
        if p.prompt is not None:
            return p.prompt
        tok = self.server.tokenizer
        return tok.decode(p.prompt_token_ids, skip_special_tokens=False) if tok is not None else ""

    def prompt_complete(self, prompt: int) -> bool:
        return self.req.logprobs is None or \
            len(self.prompt_logprobs[prompt]) == len(self.group.inputs[prompt].prompt_token_ids)

    def shown(self, c_text: str, token_ids: list[int], logprobs: list | None) -> tuple[str, list[int], list]:
        """What of a completion's output is shown: nothing of it for max_tokens 0."""
        return ("", [], []) if self.echo_only else (c_text, token_ids, logprobs or [])

    # Logprobs ----------------------------------------------------------------------------------------------
    def logprobs(self, index: int, token_ids: list[int], positions: list[PositionLogprobs],
                 prompt: int | None = None) -> dict | None:
        """OpenAI's logprobs object of `token_ids`, preceded by prompt `prompt`'s tokens when echoed."""
        if self.req.logprobs is None:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if prompt is not None:
            ids = self.group.inputs[prompt].prompt_token_ids
            for tid, position in zip(ids, self.prompt_logprobs[prompt], strict=True):
                self._add_logprob(out, index, tid, position)
        for tid, position in zip(token_ids, positions):
            self._add_logprob(out, index, tid, position)
        return out

    def _add_logprob(self, out: dict[str, list], index: int, tid: int, position: PositionLogprobs | None) -> None:
        if position is None:  # the prompt's first token: no context, no logprob
            tok = self.server.tokenizer
            token = tok.decode_piece(tid, False) if tok is not None else ""
            out["tokens"].append(token)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            ranked = ranked_logprobs(position, tid, self.req.logprobs)
            token = token_str(ranked[0][1])
            out["tokens"].append(token)
            out["token_logprobs"].append(finite_logprob(ranked[0][1].logprob))
            top: dict[str, float] = {}
            for _, lp in ranked:  # tokens that decode alike (partial UTF-8) keep the first, most relevant entry
                top.setdefault(token_str(lp), finite_logprob(lp.logprob))
            out["top_logprobs"].append(top)
        out["text_offset"].append(self.text_offsets[index])
        self.text_offsets[index] += len(token)

    # Choices -----------------------------------------------------------------------------------------------
    def stream_choices(self, index: int, c: Any) -> list[dict[str, Any]]:
        prompt = index // self.num_seqs
        if self.echo_pending[index] and not self.prompt_complete(prompt):
            self.held[index].append(c)  # until the prompt's logprobs are all in
            return []
        held, self.held[index] = self.held[index], []
        choices = []
        for d in (*held, c):
            if not self.echo_only:
                self.completion_tokens += len(d.token_ids)
            if self.echo_pending[index] or d.finish_reason is not None or \
                    (not self.echo_only and (d.text or d.logprobs or (self.server.tokenizer is None and d.token_ids))):
                choices.append(self.choice_delta(index, d))
        return choices

    def choice_delta(self, index: int, c: Any) -> dict[str, Any]:
        text, ids, lps = self.shown(c.text, c.token_ids, c.logprobs)
        prompt = None
        if self.echo_pending[index]:
            self.echo_pending[index] = False
            prompt = index // self.num_seqs
            text = self.prompt_text(prompt) + text
        return {"index": index, "text": text, "logprobs": self.logprobs(index, ids, lps, prompt),
                "finish_reason": "length" if self.echo_only and c.finish_reason is not None else c.finish_reason,
                "stop_reason": None if self.echo_only else c.stop_reason, **self.token_ids(ids)}

    def full_choice(self, index: int, a: dict[str, Any]) -> dict[str, Any]:
        text, ids, lps = self.shown("".join(a["text"]), a["token_ids"], a["logprobs"])
        prompt = a["prompt"] if self.req.echo else None
        if prompt is not None:
            text = self.prompt_text(prompt) + text
        return {"index": index, "text": text, "logprobs": self.logprobs(index, ids, lps, prompt),
                "finish_reason": "length" if self.echo_only else a["finish_reason"],
                "stop_reason": None if self.echo_only else a["stop_reason"], **self.token_ids(ids)}

    def num_generated(self, a: dict[str, Any]) -> int:
        return 0 if self.echo_only else len(a["token_ids"])

    def token_ids(self, ids: list[int]) -> dict[str, list[int]]:
        """A model without a tokenizer (random weights) has no text to send: its choices carry the token ids."""
        return {"token_ids": list(ids)} if self.server.tokenizer is None else {}


class ChatFormatter(Formatter):
    """Chat choices: the text split by the plan's parsers into `reasoning_content`, `content` and `tool_calls`
    (finish_reason "tool_calls" when the output ended with calls); streamed, each as deltas."""

    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.parsers: list[ChoiceParser] = [self.plan.choice_parser() for _ in range(self.num_choices)]

    @staticmethod
    def finish_reason(reason: str | None, has_calls: bool) -> str | None:
        return "tool_calls" if has_calls and reason == "stop" else reason

    def logprobs(self, token_ids: list[int], positions: list[PositionLogprobs]) -> dict | None:
        if not self.req.logprobs:
            return None
        top_n = self.req.top_logprobs or 0
        content = []
        for tid, position in zip(token_ids, positions):
            ranked = ranked_logprobs(position, tid, top_n)
            chosen = ranked[0][1]
            top = sorted((lp for t, lp in position.items() if lp.rank is not None and lp.rank <= top_n),
                         key=lambda lp: lp.rank)
            content.append({**_chat_token(chosen), "top_logprobs": [_chat_token(lp) for lp in top]})
        return {"content": content, "refusal": None}

    def stream_start(self) -> list[str]:
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]) for i in range(self.num_choices)]

    def choice_delta(self, index: int, c: Any) -> dict[str, Any] | None:
        parser, final = self.parsers[index], c.finish_reason is not None
        out = parser.feed(c.text, final)
        delta: dict[str, Any] = {}
        if out.reasoning:
            delta["reasoning_content"] = out.reasoning
        if out.content:
            delta["content"] = out.content
        if out.tool_calls:
            delta["tool_calls"] = out.tool_calls
        logprobs = self.logprobs(c.token_ids, c.logprobs or [])
        if not (delta or final or logprobs):
            return None
        return {"index": index, "delta": delta, "logprobs": logprobs,
                "finish_reason": self.finish_reason(c.finish_reason, parser.has_tool_calls), "stop_reason": c.stop_reason}

    def full_choice(self, index: int, a: dict[str, Any]) -> dict[str, Any]:
        out = self.parsers[index].parse("".join(a["text"]))
        message: dict[str, Any] = {"role": "assistant", "content": out.content, "refusal": None,
                                   "tool_calls": out.tool_calls}
        if self.plan.reasoning is not None:
            message["reasoning_content"] = out.reasoning
        if out.content is None and not out.tool_calls:
            message["content"] = ""
        return {"index": index, "message": message, "logprobs": self.logprobs(a["token_ids"], a["logprobs"]),
                "finish_reason": self.finish_reason(a["finish_reason"], bool(out.tool_calls)), "stop_reason": a["stop_reason"]}


class ResponsesFormatter(ChatFormatter):
    """A chat completion's deltas as a Responses API response: one output message of one output_text part, after
    a `reasoning` item when a reasoning model thought; streamed as the Responses event sequence (created,
    in_progress, [output_item.added, reasoning_text.delta..., reasoning_text.done, output_item.done for the
    reasoning,] output_item.added, content_part.added, output_text.delta..., output_text.done, content_part.done,
    output_item.done, then completed, incomplete or failed). The final response is stored (unless `store` is
    false) with the conversation it ends (the answer, not the thinking)."""

    def __init__(self, server: FormatterServer, req: ChatCompletionRequest, response_id: str, group: RequestGroup,
                 rreq: ResponsesRequest, messages: list[dict[str, Any]], plan: RequestPlan | None = None) -> None:
        super().__init__(server, req, response_id, group, plan)
        self.rreq, self.messages = rreq, messages
        self.item_id, self.reasoning_id = f"msg_{uuid.uuid4().hex}", f"rs_{uuid.uuid4().hex}"
        self.sequence_number = 0

    def response(self, status: str, text: str = "", logprobs: list | None = None, error: str | None = None,
                 reasoning: str | None = None) -> dict[str, Any]:
        done = status != "in_progress"
        output = []
        if done and error is None:
            item_status = "completed" if status == "completed" else "incomplete"
            if reasoning is not None:
                output.append(reasoning_item(self.reasoning_id, reasoning, item_status))
            output.append(message_item(self.item_id, text, item_status, logprobs))
        usage = usage_object(self.prompt_tokens, self.completion_tokens, self.reasoning_tokens or 0) if done else None
        return response_object(self.request_id, self.rreq, self.created, status=status, output=output,
                               usage=usage, error=error)

    def finish(self, text: str, token_ids: list[int], positions: list[PositionLogprobs],
               finish_reason: str | None, error: str | None) -> dict[str, Any]:
        self.completion_tokens = len(token_ids)
        if error is None:
            self.count_reasoning(token_ids)
        out = self.parsers[0].parse(text)
        logprobs = self.logprobs(token_ids, positions)
        body = self.response(final_status(finish_reason, error), out.content or "",
                             logprobs["content"] if logprobs is not None else None, error, out.reasoning)
        if self.rreq.store and error is None:
            self.server.responses.put(body, [*self.messages, {"role": "assistant", "content": out.content or ""}])
        return body

    async def collect(self) -> Response:
        text, token_ids, positions, finish_reason = [], [], [], None
        try:
            async for delta in self.group:
                for c in delta.completions:
                    text.append(c.text)
                    token_ids += c.token_ids
                    positions += c.logprobs or []
                    finish_reason = c.finish_reason or finish_reason
        except Exception as e:  # the engine failed this request: not the client's fault
            raise APIError(500, str(e), type="server_error") from None
        return JSONResponse(self.finish("".join(text), token_ids, positions, finish_reason, None))

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json_encode(body).decode()}\n\n"

    def open_message(self, index: int) -> list[str]:
        where = {"item_id": self.item_id, "output_index": index, "content_index": 0}
        return [self.event("response.output_item.added", output_index=index,
                           item=message_item(self.item_id, "", "in_progress", None)),
                self.event("response.content_part.added", **where, part=output_text_part("", None))]

    def begin_message(self, reasoning: list[str] | None) -> tuple[int, list[str]]:
        """The message's output index and the events that end the reasoning item (if one began) and open it."""
        if reasoning is None:
            return 0, self.open_message(0)
        text, where = "".join(reasoning), {"item_id": self.reasoning_id, "output_index": 0, "content_index": 0}
        return 1, [self.event("response.reasoning_text.done", **where, text=text),
                   self.event("response.output_item.done", output_index=0,
                              item=reasoning_item(self.reasoning_id, text, "completed")), *self.open_message(1)]

    async def events(self) -> AsyncIterator[str]:
        start = self.response("in_progress")
        yield self.event("response.created", response=start)
        yield self.event("response.in_progress", response=start)
        parser = self.parsers[0] if self.plan.reasoning is not None else None
        message_at = None  # the message's output index, once it is open: at once when the model does not think
        if parser is None:
            message_at, opening = self.begin_message(None)
            for e in opening:
                yield e
        reasoning: list[str] | None = None  # the thinking streamed so far, once it has begun
        text, token_ids, positions, finish_reason = [], [], [], None
        try:
            async for delta in self.group:
                for c in delta.completions:
                    token_ids += c.token_ids
                    positions += c.logprobs or []
                    finish_reason = c.finish_reason or finish_reason
                    text.append(c.text)
                    out = parser.feed(c.text, c.finish_reason is not None) if parser is not None else None
                    thought, content = (out.reasoning, out.content) if out is not None else (None, c.text)
                    if thought and message_at is None:
                        if reasoning is None:
                            reasoning = []
                            yield self.event("response.output_item.added", output_index=0,
                                             item=reasoning_item(self.reasoning_id, "", "in_progress"))
                        reasoning.append(thought)
                        yield self.event("response.reasoning_text.delta", item_id=self.reasoning_id,
                                         output_index=0, content_index=0, delta=thought)
                    if content:
                        if message_at is None:
                            message_at, opening = self.begin_message(reasoning)
                            for e in opening:
                                yield e
                        logprobs = self.logprobs(c.token_ids, c.logprobs or [])
                        yield self.event("response.output_text.delta", item_id=self.item_id, output_index=message_at,
                                         content_index=0, delta=content,
                                         logprobs=logprobs["content"] if logprobs is not None else [])
        except KilnRuntimeError as e:  # the engine failed this request mid-stream
            yield self.event("response.failed", response=self.finish("", [], [], None, str(e)))
            return
        body = self.finish("".join(text), token_ids, positions, finish_reason, None)
        if message_at is None:  # no answer: the thinking ends here, then an empty message
            message_at, opening = self.begin_message(reasoning)
            for e in opening:
                yield e
        message = body["output"][-1]
        part, where = message["content"][0], {"item_id": self.item_id, "output_index": message_at, "content_index": 0}
        yield self.event("response.output_text.done", **where, text=part["text"], logprobs=part.get("logprobs", []))
        yield self.event("response.content_part.done", **where, part=part)
        yield self.event("response.output_item.done", output_index=message_at, item=message)
        yield self.event(f"response.{body['status']}", response=body)


def _chat_token(lp: Any) -> dict[str, Any]:
    token = token_str(lp)
    return {"token": token, "logprob": finite_logprob(lp.logprob), "bytes": list(token.encode("utf-8"))}
