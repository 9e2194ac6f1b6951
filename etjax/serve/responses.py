"""OpenAI-shaped answers: a whole completion, a stream's chunks, usage and log-probabilities.

The shapes are OpenAI's (and so what its clients parse): `text_completion` and
`chat.completion` objects, `*.chunk` objects in a stream, `usage` with
`prompt_tokens_details.cached_tokens` (the prompt tokens the prefix cache served: those of the
first sample, as later samples find the prompt it prefilled), and chat log-probabilities as
`{"content": [{token, logprob, bytes, top_logprobs}]}` (etjax/jobs/openai_format.py writes
the same for batch jobs), completions' as `{tokens, token_logprobs, top_logprobs,
text_offset}`. etjax's own additions ride in an `etjax` key of a choice, only when
the request asks: with `etjax.trace` the sample's seed and each new token's entropy trace,
with `etjax.prompt_logprobs` each prompt token's log-probability (on the sample's last chunk).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from etjax.jobs.openai_format import CHAT
from etjax.runtime.options import DRAFT_COUNTS, TRACE_FIELDS, SequenceOutput
from etjax.serve.body import ServeRequest
from etjax.serve.bridge import Delta
from etjax.serve.errors import ApiError

TokenText = Callable[[int], str]


def finish_reason(reason: str) -> str:
    """OpenAI's name for an engine finish: an end-of-sequence token or a stop string is
    "stop", a length limit "length". An engine "error" is no answer (`check_finished`)."""
    return "length" if reason == "length" else "stop"


def check_finished(index: int, out: SequenceOutput) -> None:
    """ApiError 500 for a sample the engine ended with an error (its grammar engine failed
    on a constrained request: `out.error` says why): never sent as a success."""
    if out.finish_reason == "error":
        why = out.error or "see the server's log"
        raise ApiError(500, f"sample {index} failed in the engine: {why}", code="engine_error")


class Shape:
    """The fixed parts of one request's answer: id, object names, creation time, model."""

    def __init__(self, request: ServeRequest, model_name: str, token_text: TokenText) -> None:
        self.request, self.model_name, self.token_text = request, model_name, token_text
        self.chat = request.url == CHAT
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._offsets = [0] * len(request.samples)  # completions logprobs' text_offset

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_name}

    def whole(self, outputs: list[SequenceOutput]) -> dict:
        """The answer of a request that was not streamed."""
        choices = []
        for i, out in enumerate(outputs):
            check_finished(i, out)
            choice = {"index": i}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": out.text}
            else:
                choice["text"] = out.text
            choice["logprobs"] = self._logprobs(i, out.token_ids, out.logprob, out.top_logprobs)
            choice["finish_reason"] = finish_reason(out.finish_reason)
            choice |= self._etjax(i, {name: getattr(out, name) for name in TRACE_FIELDS}, out)
            choices.append(choice)
        obj = "chat.completion" if self.chat else "text_completion"
        return self._head(obj) | {"choices": choices, "usage": self.usage(outputs)}

    def role_chunk(self) -> dict:
        """A chat stream's first chunk: each choice's role."""
        choices = [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
            | {"finish_reason": None}
            for i in range(len(self.request.samples))
        ]
        return self._chunk(choices)

    def chunk(self, deltas: list[Delta]) -> dict:
        """A stream chunk with the new output of one round (a choice per sample that moved)."""
        choices = []
        for d in deltas:
            if d.output is not None:
                check_finished(d.index, d.output)
            choice = {"index": d.index}
            if self.chat:
                choice["delta"] = {"content": d.text}
            else:
                choice["text"] = d.text
            choice["logprobs"] = self._logprobs(d.index, d.token_ids, d.logprobs, d.top_logprobs)
            choice["finish_reason"] = (
                None if d.finish_reason is None else finish_reason(d.finish_reason)
            )
            choices.append(choice | self._etjax(d.index, d.trace, d.output))
        return self._chunk(choices)

    def usage_chunk(self, outputs: list[SequenceOutput]) -> dict:
        """The last chunk of a stream with stream_options.include_usage: no choices."""
        return self._chunk([]) | {"usage": self.usage(outputs)}

    def _chunk(self, choices: list[dict]) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = self._head(obj) | {"choices": choices}
        if self.request.include_usage:
            chunk["usage"] = None  # as OpenAI: null on every chunk but the last
        return chunk

    def usage(self, outputs: list[SequenceOutput]) -> dict:
        prompt = len(self.request.prompt_ids)
        completion = sum(len(out.token_ids) for out in outputs)
        cached = int(outputs[0].metrics.get("cached_tokens", 0)) if outputs else 0
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _logprobs(self, index: int, token_ids, logprobs, tops) -> dict | None:
        if not self.request.logprobs:
            return None
        if not self.chat:
            return self._completion_logprobs(index, token_ids, logprobs, tops)
        # Chat's shape; each token's bytes are its text's UTF-8 (a token ending inside a
        # character reads U+FFFD, as etjax/jobs/openai_format.py writes it).

        def entry(token: int, logprob: float) -> dict:
            text = self.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        tops = tops or [[] for _ in token_ids]
        return {
            "content": [
                entry(token, value) | {"top_logprobs": [entry(t, v) for t, v in top]}
                for token, value, top in zip(token_ids, logprobs, tops, strict=True)
            ]
        }

    def _completion_logprobs(self, index: int, token_ids, logprobs, tops) -> dict:
        # The legacy completions shape: parallel lists, each alternative as {text: logprob},
        # and each token's offset in the choice's text (counted on across a stream's chunks).
        texts = [self.token_text(t) for t in token_ids]
        offsets = []
        for text in texts:
            offsets.append(self._offsets[index])
            self._offsets[index] += len(text)
        tops = tops or [[] for _ in token_ids]
        return {
            "tokens": texts,
            "token_logprobs": list(logprobs),
            "top_logprobs": [{self.token_text(t): v for t, v in top} for top in tops],
            "text_offset": offsets,
        }

    def _etjax(self, index: int, trace: dict[str, list[float]], out: SequenceOutput | None):
        # etjax's additions to a choice: with etjax.trace its seed and trace (of the tokens
        # at hand), with etjax.prompt_logprobs those, once the sample is done.
        extra = {}
        if self.request.trace:
            extra = {"seed": self.request.samples[index].sampler.seed, "trace": trace}
        if out is not None and out.prompt_logprobs is not None:
            extra["prompt_logprobs"] = out.prompt_logprobs
        if self.request.trace and out is not None and out.finish_reason:
            # What speculation did for the sample, once it is done (etjax.Result's counts).
            extra |= {name: int(out.metrics.get(name, 0)) for name in DRAFT_COUNTS}
        return {"etjax": extra} if extra else {}
