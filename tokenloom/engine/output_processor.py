"""After sampling: append tokens, detokenize incrementally, apply stop conditions, cut the stream delta.

Stop conditions, checked token by token (so a multi-token append stops exactly at the first hit):
stop token id (EOS unless ignore_eos, and the request's stop_token_ids; its text is not emitted),
stop string (text cut before it; the string is not emitted unless include_stop_str_in_output),
a complete grammar (the request's output constraint, engine/constraint.py), max_tokens. None applies before min_tokens tokens have been produced.
While a sequence runs, the last `stop_buffer_chars` characters are held back from the stream since
they may turn out to be the start of a stop string.
This module alone writes a sequence's `output` state (engine/sequence.py OutputState).
"""

from __future__ import annotations

from tokenloom.engine.sequence import Sequence, SequenceStatus
from tokenloom.outputs import CompletionOutput, TokenLogprob
from tokenloom.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def append(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> SequenceStatus | None:
        """Append one sampled token to `seq`; returns the finishing status if it ends the sequence."""
        p, out = seq.params, seq.output
        seq.token_ids.append(token)
        if logprob is not None:
            out.logprobs.append(logprob)
            out.cumulative_logprob += logprob.logprob
        n_out = seq.num_output_tokens
        may_stop = n_out >= p.min_tokens
        if may_stop and token in seq.stop_token_ids:
            out.finish_reason = "stop"
            out.stop_reason = None if token not in p.stop_token_ids else token
            return SequenceStatus.FINISHED_STOPPED
        # The grammar advances on every token (a token it refuses raises: the sequence fails alone).
        grammar_done = seq.constraint is not None and seq.constraint.append(token)
        if out.decoder is None:
            out.decoder = self.tokenizer.decode_stream(p.skip_special_tokens)
        new_text = out.decoder.step(self.tokenizer.backend, token) or ""
        out.text += new_text
        if may_stop and p.stop and new_text and _check_stop_strings(seq, len(new_text)):
            return SequenceStatus.FINISHED_STOPPED
        if grammar_done:  # complete: only a stop token could follow, so stop without sampling one
            out.finish_reason = "stop"
            return SequenceStatus.FINISHED_STOPPED
        if n_out >= seq.max_tokens:
            out.finish_reason = "length"
            return SequenceStatus.FINISHED_LENGTH
        return None


def _check_stop_strings(seq: Sequence, new_chars: int) -> bool:
    out = seq.output
    text = out.text
    longest = max(len(s) for s in seq.params.stop)
    # Only a window that overlaps the new characters can hold a new match.
    window_start = max(0, len(text) - new_chars - longest + 1)
    best: tuple[int, str] | None = None
    for s in seq.params.stop:
        at = text.find(s, window_start)
        if at != -1 and (best is None or at < best[0]):
            best = (at, s)
    if best is None:
        return False
    at, s = best
    out.text = text[: at + len(s)] if seq.params.include_stop_str_in_output else text[:at]
    out.finish_reason = "stop"
    out.stop_reason = s
    return True


def take_delta(seq: Sequence, finished: bool) -> CompletionOutput | None:
    """The text, tokens and logprobs produced since the last call; None when there is nothing new."""
    out = seq.output
    if out.final_emitted:
        return None
    hold = 0 if finished else seq.params.stop_buffer_chars
    text_end = max(out.num_emitted_chars, len(out.text) - hold)
    num_out = seq.num_output_tokens
    if text_end == out.num_emitted_chars and num_out == out.num_emitted_tokens and not finished:
        return None
    text = out.text[out.num_emitted_chars : text_end]
    new_ids = seq.token_ids[seq.prompt_len + out.num_emitted_tokens :]  # only the new tokens are copied
    lps = out.logprobs[out.num_emitted_tokens :] if seq.params.logprobs is not None else None
    out.num_emitted_chars = text_end
    out.num_emitted_tokens = num_out
    out.final_emitted = finished
    return CompletionOutput(
        index=seq.index,
        text=text,
        token_ids=new_ids,
        finish_reason=out.finish_reason if finished else None,
        stop_reason=out.stop_reason if finished else None,
        logprobs=lps,
        cumulative_logprob=out.cumulative_logprob if seq.params.logprobs is not None else None,
    )
