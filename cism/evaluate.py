"""Perplexity and KL divergence as library calls (what `cism perplexity` runs).

    import cism, cism.evaluate
    model = cism.load("SmolLM2-135M-Instruct.Q4_1.gguf", precision="int8")
    r = cism.evaluate.perplexity(model, text, ctx=512)
    print(r.ppl, r.ppl_error, r.to_dict())

The protocol is llama-perplexity's: the text tokenized once, with BOS in
front when the model adds one and special-token text left as text; non-
overlapping windows of ctx tokens of that sequence, each starting with BOS in
place of its first token when the model adds one; only the second half of
each window scored (the first half is context, so every scored token sees at
least ctx/2 tokens before it). KL divergence compares each scored position's
distribution with a base's: another model, or log-probabilities saved by an
earlier run (`save_kl_base`, float16, shape (windows, ctx - 1 - ctx/2, vocab)).
"""
import dataclasses
import math

import numpy as np

__all__ = ["EvaluationError", "PerplexityResult", "kl_divergence", "log_softmax", "perplexity"]


class EvaluationError(ValueError):
    """Inputs the protocol cannot run on (too short a text, a base that does
    not match); the CLI prints these as one-line errors, after the file's
    name when `about_text`."""

    def __init__(self, message, about_text=False):
        super().__init__(message)
        self.about_text = about_text


@dataclasses.dataclass
class PerplexityResult:
    """One evaluation. `to_dict()` gives the keys of `cism perplexity --json`
    (`model` and `normalize_newlines` only when the caller filled them in,
    `kld` and `top1_agreement` only with a base). `nll` holds every scored
    token's negative log-likelihood (nats), `kl` every scored position's KL
    divergence from the base; `cancelled` says the progress callback stopped
    the run early, and the figures then cover the windows done."""
    precision: str
    act_precision: str
    prefill_precision: str
    kv_precision: str
    text_tokens: int
    ctx: int
    chunks: int
    tokens_scored: int
    ppl: float
    ppl_error: float
    mean_nll: float
    kld: dict | None = None
    top1_agreement: float | None = None
    model: str | None = None
    normalize_newlines: bool | None = None
    cancelled: bool = False
    nll: np.ndarray = dataclasses.field(default=None, repr=False)
    kl: np.ndarray | None = dataclasses.field(default=None, repr=False)

    # the CLI's key order
    _KEYS = ("model", "precision", "act_precision", "prefill_precision", "kv_precision",
             "normalize_newlines", "text_tokens", "ctx", "chunks", "tokens_scored", "ppl",
             "ppl_error", "mean_nll", "kld", "top1_agreement")

    def to_dict(self):
        d = {k: getattr(self, k) for k in self._KEYS if getattr(self, k) is not None}
        if self.cancelled:
            d["cancelled"] = True
        return d


def log_softmax(z):
    """Row-wise log-softmax in float64 (the scoring precision of every figure here)."""
    z = z.astype(np.float64)
    z -= z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _token_ids(model, text_or_ids):
    """(ids, add_bos): a text tokenized as llama-perplexity does, or token ids
    taken as they are (BOS included by the caller if the model wants one)."""
    tok = model.tokenizer
    add_bos_model = tok is not None and tok.add_bos and tok.bos_id is not None
    if isinstance(text_or_ids, str):
        if tok is None:
            raise EvaluationError("the model has no tokenizer next to it; perplexity needs one "
                                  "(or pass token ids)")
        return tok.encode(text_or_ids, add_bos=add_bos_model, parse_special=False), add_bos_model
    ids = [int(t) for t in text_or_ids]
    return ids, add_bos_model


def _base_source(kl_base, model, n_chunks, width):
    """A function window_index, window -> base log-probabilities (width, vocab)."""
    vocab = model.config.vocab
    if hasattr(kl_base, "logits_all"):
        if kl_base.config.vocab != vocab:
            raise EvaluationError(f"the base model's vocabulary ({kl_base.config.vocab}) is not "
                                  f"this model's ({vocab})")
        return lambda c, window: log_softmax(kl_base.logits_all(window)[len(window) // 2:-1])
    is_path = isinstance(kl_base, (str, bytes)) or hasattr(kl_base, "__fspath__")
    base = np.load(kl_base, mmap_mode="r") if is_path else np.asarray(kl_base)
    need = (n_chunks, width, vocab)
    if base.ndim != 3 or base.shape[0] < n_chunks or base.shape[1:] != need[1:]:
        raise EvaluationError(f"{kl_base if is_path else 'kl_base'}: saved log-probabilities have "
                              f"shape {base.shape}, need at least {need} (same model vocabulary, "
                              "--ctx and text)")
    return lambda c, window: np.asarray(base[c], np.float64)


def perplexity(model, text_or_ids, ctx=512, chunks=None, kl_base=None, save_kl_base=None,
               progress=None):
    """Perplexity of `model` over a text (str) or token ids, by
    llama-perplexity's protocol (see the module's docstring).

    chunks: score at most this many windows (None or 0: all).
    kl_base: a model, saved log-probabilities (.npy path or array) of an
        earlier run, or None; with one, the result has KLD statistics (nats)
        and the top-1 agreement.
    save_kl_base: a .npy path to write this run's log-probabilities to
        (float16), for a later kl_base.
    progress: called as progress(windows_done, windows_total, ppl_so_far)
        after every window; returning False stops the run (the result then
        has cancelled=True and covers the windows done).
    """
    if ctx < 8:
        raise EvaluationError("ctx must be at least 8")
    ids, add_bos = _token_ids(model, text_or_ids)
    n_chunks = len(ids) // ctx
    if chunks:
        n_chunks = min(n_chunks, chunks)
    if n_chunks == 0:
        raise EvaluationError(f"{len(ids)} tokens is less than one window of --ctx {ctx}", True)
    first = ctx // 2
    width = ctx - 1 - first
    base = None if kl_base is None else _base_source(kl_base, model, n_chunks, width)
    save = None
    if save_kl_base:
        save = np.lib.format.open_memmap(save_kl_base, mode="w+", dtype=np.float16,
                                         shape=(n_chunks, width, model.config.vocab))
    nll, kls, same = [], [], []
    cancelled = False
    for c in range(n_chunks):
        window = ids[c * ctx:(c + 1) * ctx]
        if add_bos:
            window = [model.tokenizer.bos_id] + window[1:]
        lp = log_softmax(model.logits_all(window)[first:-1])
        targets = np.array(window[first + 1:])
        nll.extend((-lp[np.arange(len(targets)), targets]).tolist())
        if save is not None:
            save[c] = lp.astype(np.float16)
        if base is not None:
            ref = base(c, window)
            kls.extend((np.exp(ref) * (ref - lp)).sum(-1).tolist())
            same.extend((ref.argmax(-1) == lp.argmax(-1)).tolist())
        if progress is not None and progress(c + 1, n_chunks, math.exp(float(np.mean(nll)))) is False:
            cancelled = c + 1 < n_chunks
            n_chunks = c + 1
            break
    if save is not None:
        save.flush()
    nll = np.array(nll)
    mean = float(nll.mean())
    sem = float(nll.std(ddof=1) / math.sqrt(len(nll))) if len(nll) > 1 else 0.0
    ppl = math.exp(mean)
    r = PerplexityResult(precision=model.precision, act_precision=model.act_precision,
                         prefill_precision=getattr(model, "prefill_precision", "exact"),
                         kv_precision=getattr(model, "kv_precision", "fp32"),
                         text_tokens=len(ids), ctx=ctx, chunks=n_chunks, tokens_scored=int(len(nll)),
                         ppl=ppl, ppl_error=ppl * sem, mean_nll=mean, cancelled=cancelled, nll=nll)
    if base is not None:
        k = np.array(kls)
        r.kl = k
        r.kld = {"mean": float(k.mean()), "error": float(k.std(ddof=1) / math.sqrt(len(k))),
                 "median": float(np.median(k)),
                 **{f"p{q}": float(np.percentile(k, q)) for q in (90, 95, 99, 99.9)},
                 "max": float(k.max())}
        r.top1_agreement = float(np.mean(same))
    return r


def kl_divergence(model, base, text_or_ids, ctx=512, chunks=None, progress=None):
    """KL divergence of `model`'s next-token distributions from `base`'s over a
    text, on perplexity()'s scored positions: `base` is another model (two
    precisions or two files in one call, the same vocabulary) or saved
    log-probabilities (a .npy path or array from save_kl_base). Returns the
    PerplexityResult of `model`, with `kld`, `kl` and `top1_agreement`.

    A base model's log-probabilities are used in float64 as computed; saved
    ones went through float16, so the two routes agree to about 1e-4 nats in
    the mean, not bit for bit."""
    if base is None:
        raise EvaluationError("kl_divergence needs a base model or saved log-probabilities")
    return perplexity(model, text_or_ids, ctx=ctx, chunks=chunks, kl_base=base, progress=progress)
