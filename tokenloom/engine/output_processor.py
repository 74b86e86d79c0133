"""After sampling: append tokens, detokenize incrementally, apply stop conditions, cut the stream delta.

Stop conditions, checked token by token (so a multi-token append stops exactly at the first hit):
stop token id (EOS unless ignore_eos, and the request's stop_token_ids; its text is not emitted),
stop string (text cut before it; the string is not emitted unless include_stop_str_in_output),
max_tokens. None applies before min_tokens tokens have been produced.
While a sequence runs, the last `stop_buffer_chars` characters are held back from the stream since
they may turn out to be the start of a stop string.
"""

from __future__ import annotations

from tokenloom.engine.sequence import Sequence, SequenceStatus, TokenLogprob
from tokenloom.outputs import CompletionOutput
from tokenloom.tokenizer import Tokenizer


def append_tokens(
    seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob | None], tokenizer: Tokenizer
) -> SequenceStatus | None:
    """Append sampled tokens to `seq`; returns the finishing status if one of them ends it."""
    p = seq.params
    for token, lp in zip(tokens, logprobs):
        seq.token_ids.append(token)
        if lp is not None:
            seq.logprobs.append(lp)
            seq.cumulative_logprob += lp.logprob
        n_out = seq.num_output_tokens
        may_stop = n_out >= p.min_tokens
        if may_stop and token in seq.stop_token_ids:
            seq.finish_reason = "stop"
            seq.stop_reason = None if token not in p.stop_token_ids else token
            return SequenceStatus.FINISHED_STOPPED
        if seq.decoder is None:
            seq.decoder = tokenizer.decode_stream(p.skip_special_tokens)
        new_text = seq.decoder.step(tokenizer.backend, token) or ""
        seq.output_text += new_text
        if may_stop and p.stop and new_text and _check_stop_strings(seq, len(new_text)):
            return SequenceStatus.FINISHED_STOPPED
        if n_out >= seq.max_tokens:
            seq.finish_reason = "length"
            return SequenceStatus.FINISHED_LENGTH
    return None


def _check_stop_strings(seq: Sequence, new_chars: int) -> bool:
    text = seq.output_text
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
    seq.output_text = text[: at + len(s)] if seq.params.include_stop_str_in_output else text[:at]
    seq.finish_reason = "stop"
    seq.stop_reason = s
    return True


def take_delta(seq: Sequence, finished: bool) -> CompletionOutput | None:
    """The text, tokens and logprobs produced since the last call; None when there is nothing new."""
    if seq.final_emitted:
        return None
    hold = 0 if finished else seq.params.stop_buffer_chars
    text_end = max(seq.num_emitted_chars, len(seq.output_text) - hold)
    out_ids = seq.output_token_ids
    if text_end == seq.num_emitted_chars and len(out_ids) == seq.num_emitted_tokens and not finished:
        return None
    text = seq.output_text[seq.num_emitted_chars : text_end]
    new_ids = out_ids[seq.num_emitted_tokens :]
    lps = seq.logprobs[seq.num_emitted_tokens :] if seq.params.logprobs is not None else None
    seq.num_emitted_chars = text_end
    seq.num_emitted_tokens = len(out_ids)
    seq.final_emitted = finished
    return CompletionOutput(
        index=seq.index,
        text=text,
        token_ids=new_ids,
        finish_reason=seq.finish_reason if finished else None,
        stop_reason=seq.stop_reason if finished else None,
        logprobs=lps,
        cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
    )
