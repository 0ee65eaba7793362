"""Text in, text out: ``model.generate(...)`` and ``model.stream(...)``.

Both work for every model family whose Model has ``create_session`` and a
tokenizer (loaded with the checkpoint by ``from_pretrained``/``cism.load``,
or set with ``model.tokenizer = cism.Tokenizer...``).

    result = model.generate("The capital of France is", max_new_tokens=16)
    print(result.text, result.finish_reason, result.tokens_per_second)

    stream = model.stream("Tell me a story.", chat=True, max_new_tokens=200)
    for piece in stream:
        print(piece, end="", flush=True)
    print(stream.result.finish_reason)
"""
import math
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Generation:
    """The outcome of one generation."""
    text: str
    tokens: list
    finish_reason: str              # "stop" (eos or a stop string), "length" or "cancelled"
    prompt_tokens: int
    logprobs: list = None           # log-probability of each token under the model (raw logits)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stop_string: str = None         # which stop string ended it, if any
    spec_stats: tuple = field(default=(0, 0))

    @property
    def tokens_per_second(self):
        """Decode rate (the first token, which needs the prompt, excluded)."""
        n = len(self.tokens) - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


class TextStream:
    """An iterator of text pieces; ``result`` holds the Generation once done.
    ``cancel()`` (from any thread) stops it after the current step."""

    def __init__(self, steps, session):
        self._steps = steps
        self.session = session
        self.result = None

    def __iter__(self):
        return self

    def __next__(self):
        while True:
            item = next(self._steps)  # StopIteration ends the stream
            if isinstance(item, Generation):
                self.result = item
                raise StopIteration
            if item:
                return item

    def cancel(self):
        self.session.cancel()


def _log_softmax_at(logits, token):
    z = logits.astype(np.float64)
    m = z.max()
    return float(z[token] - m - math.log(np.exp(z - m).sum()))


class _StopFinder:
    """Finds stop strings in streamed text; holds back only the text that
    could still become the start of a stop string."""

    def __init__(self, stops):
        self.stops = [s for s in stops if s]
        self.keep = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.emitted = 0

    def feed(self, piece):
        """Returns (text safe to emit, stop string found or None)."""
        self.text += piece
        if self.stops:
            hits = [(self.text.find(s, max(0, self.emitted - len(s) + 1)), s) for s in self.stops]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                out = self.text[self.emitted:i]
                self.text = self.text[:i]
                self.emitted = i
                return out, s
        safe = len(self.text) - self.keep if self.stops else len(self.text)
        safe = max(safe, self.emitted)
        out = self.text[self.emitted:safe]
        self.emitted = safe
        return out, None

    def flush(self):
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out


class GenerationMixin:
    """generate/stream on top of a family's create_session."""

    _tokenizer = None

    @property
    def tokenizer(self):
        """The checkpoint's tokenizer (loaded on first use), or None."""
        if self._tokenizer is None:
            source = getattr(self, "source", None)
            info = getattr(source, "tokenizer", None) if source is not None else None
            if info:
                from cism.tokenizers import Tokenizer
                self._tokenizer = Tokenizer.from_pretrained(info["path"])
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value):
        self._tokenizer = value

    def _prompt_ids(self, prompt, chat, system):
        tok = self.tokenizer
        if isinstance(prompt, str):
            if tok is None:
                raise ValueError("this model has no tokenizer: pass token ids or set model.tokenizer")
            if chat:
                messages = ([{"role": "system", "content": system}] if system else []) + \
                           [{"role": "user", "content": prompt}]
                return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True),
                                  add_bos=False)
            return tok.encode(prompt)
        if chat:
            raise ValueError("chat=True needs a text prompt")
        return list(prompt)

    def _steps(self, prompt, max_new_tokens, temperature, top_p, top_k, min_p, repetition_penalty,
               seed, stop, spec_k, logprobs, chat, system, eos, session_box):
        tok = self.tokenizer
        if isinstance(stop, str):
            stop = [stop]
        stop = list(stop or [])
        if stop and tok is None:
            raise ValueError("stop strings need a tokenizer")
        ids = self._prompt_ids(prompt, chat, system)
        if eos is None:
            eos = list(tok.eos_ids) if tok is not None else []
        session = self.create_session(ids, max_new_tokens, temperature, top_p, top_k, seed, eos,
                                      min_p=min_p, repetition_penalty=repetition_penalty)
        session_box.append(session)
        return self._run(session, tok, ids, stop, spec_k, logprobs)

    def _run(self, session, tok, ids, stop, spec_k, logprobs):
        decoder = tok.stream_decoder(skip_special=True) if tok is not None else None
        finder = _StopFinder(stop)
        tokens, lps = [], ([] if logprobs else None)
        t0 = time.perf_counter()
        session.prefill()
        t_first = time.perf_counter()
        prefill_s = t_first - t0
        hit = None
        step = 1 if (spec_k == 0 or logprobs) else spec_k + 1
        # a file the weights are mapped from is checked before every step (one fstat)
        check_files = getattr(self, "check_mapped_files", None)
        while not session.finish_reason:
            if check_files is not None:
                check_files()
            logits = session.last_logits if logprobs else None
            new = session.next_tokens(step, spec_k=0 if logprobs else spec_k)
            if not new:
                break
            if logprobs:
                lps.append(_log_softmax_at(logits, new[0]))
            tokens += new
            if decoder is not None:
                piece = "".join(decoder.push(t) for t in new)
                out, hit = finder.feed(piece)
                if out:
                    yield out
                if hit is not None:
                    session.cancel()  # stop generating: the text is complete
                    break
        if decoder is not None and hit is None:
            out, hit = finder.feed(decoder.flush())
            if out:
                yield out
            if hit is None:
                rest = finder.flush()
                if rest:
                    yield rest
        reason = "stop" if hit is not None else session.finish_reason
        spec = session.spec_stats() if hasattr(session, "spec_stats") else (0, 0)
        yield Generation(text=finder.text if decoder is not None else "", tokens=tokens,
                         finish_reason=reason, prompt_tokens=len(ids), logprobs=lps,
                         prefill_seconds=prefill_s, decode_seconds=time.perf_counter() - t_first,
                         stop_string=hit, spec_stats=tuple(spec))

    def stream(self, prompt, max_new_tokens=256, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
               repetition_penalty=1.0, seed=0, stop=(), spec_k=0, logprobs=False, chat=False,
               system=None, eos=None):
        """Like generate(), but returns a TextStream yielding text pieces as
        they are decoded (never half a UTF-8 character, never text that a
        stop string will cut)."""
        box = []
        steps = self._steps(prompt, max_new_tokens, temperature, top_p, top_k, min_p,
                            repetition_penalty, seed, stop, spec_k, logprobs, chat, system, eos, box)
        return TextStream(steps, box[0])

    def generate(self, prompt, max_new_tokens=256, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                 repetition_penalty=1.0, seed=0, stop=(), spec_k=0, logprobs=False, chat=False,
                 system=None, eos=None):
        """Generate from a text prompt (or token ids) and return a Generation.

        ``stop``: strings that end the generation (cut before them, finish
        reason "stop"); ``chat``: wrap the prompt in the model's chat
        template (``system`` adds a system message); ``logprobs``: also
        return each token's log-probability under the model; ``spec_k``:
        prompt-lookup speculation (greedy only, same tokens). ``eos``
        defaults to the tokenizer's end tokens. min_p and repetition_penalty
        are off by default, so the spec's sampling stays bit-exact."""
        stream = self.stream(prompt, max_new_tokens, temperature, top_p, top_k, min_p,
                             repetition_penalty, seed, stop, spec_k, logprobs, chat, system, eos)
        for _ in stream:
            pass
        return stream.result
