"""cism as an lm-evaluation-harness backend: importing this module registers
the model name "cism" with lm-eval (`pip install "cism[eval]"`).

    import lm_eval, cism.lm_eval
    lm_eval.simple_evaluate(model="cism", model_args="pretrained=PATH,precision=int8",
                            tasks=["my_task"], task_manager=lm_eval.tasks.TaskManager(include_path=DIR))

or from the shell, lm-eval's own command line with cism registered first:

    python -m cism.lm_eval --model cism --model_args pretrained=PATH --tasks my_task --include_path DIR
    cism-lm-eval --model cism ...          (the same, as an installed script)

`lm_eval --model cism` itself cannot work with lm-eval 0.4.13: its model
registry accepts entry points as lazy entries but nothing reads an entry-point
group into it (lm_eval/models/__init__.py registers its own MODEL_MAPPING
only), and the command imports no user module before looking the name up
(--include_path is read for task YAMLs, not for models).

model_args: pretrained (a path, or a loaded cism model), precision,
act_precision, kv_precision, prefill_precision, threads, max_length (default:
the model's max_position_embeddings), fork (default true), add_bos_token
(default: the tokenizer's own), seed (sampled generation).

Conventions are lm-eval's, as its HF backend applies them: contexts and
continuations are split by TemplateLM._encode_pair (the whole text encoded,
the context's tokens cut off), texts are encoded with the tokenizer's default
BOS and special tokens parsed, an empty context is the BOS (else EOS) token,
and too long inputs lose tokens on the left. Continuations are scored in
float64 from the model's float32 logits.

Multiple choice: requests that share a context are scored together. On dense
models (Llama, Mistral, Qwen2/3) the context is prefilled once into the paged
pool and every continuation runs in a copy-on-write fork of it
(`create_paged_fork_session`), so a context is computed once per question,
not once per choice. The other families (FWKV, Surjo) have no paged forks;
they, and dense models with fork=false, run logits_all over context and
continuation per request.
"""
import sys

import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from tqdm import tqdm

from cism.evaluate import log_softmax

__all__ = ["CismLM"]


class CismLM(TemplateLM):
    def __init__(self, pretrained=None, precision="auto", act_precision="fp32", kv_precision="fp32",
                 prefill_precision="exact", threads=None, max_length=None, fork=True,
                 add_bos_token=None, seed=0, max_gen_toks=256, **_lm_eval_options):
        # (_lm_eval_options: batch_size, max_batch_size and device, which
        # simple_evaluate passes to every backend; a CPU model has no use for them)
        super().__init__()
        if pretrained is None:
            raise ValueError("model_args needs pretrained=PATH (an HF directory, .gguf or llama2.c .bin)")
        if isinstance(pretrained, str):
            import cism
            options = {} if kv_precision == "fp32" else {"kv_precision": kv_precision}
            self.model = cism.load(pretrained, precision=precision, act_precision=act_precision,
                                   threads=threads, **options)
            if prefill_precision != "exact":
                self.model.set_prefill_precision(prefill_precision)
        else:
            self.model = pretrained
        self.tokenizer = self.model.tokenizer
        if self.tokenizer is None:
            raise ValueError("the model has no tokenizer next to it; lm-eval needs one")
        self.add_bos = self.tokenizer.add_bos if add_bos_token is None else bool(add_bos_token)
        self._max_length = int(max_length or self.model.config.context)
        self.fork = bool(fork) and hasattr(self.model, "create_paged_fork_session")
        self.seed = int(seed)
        self._max_gen_toks = int(max_gen_toks)

    # ---- tokens ----

    @property
    def eot_token_id(self):
        return self.tokenizer.eos_ids[0]

    @property
    def prefix_token_id(self):
        bos = self.tokenizer.bos_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self):
        return self._max_length

    @property
    def max_gen_toks(self):
        return self._max_gen_toks

    def tok_encode(self, string, add_special_tokens=None, left_truncate_len=None, **kwargs):
        tok = self.tokenizer
        # HF's add_special_tokens: None and True are the tokenizer's default
        # (here add_bos), False none; a text that starts with BOS gets no second one
        add_bos = self.add_bos and add_special_tokens is not False
        if add_special_tokens is None and tok.bos_id is not None \
                and string.startswith(tok.decode([tok.bos_id])):
            add_bos = False
        ids = tok.encode(string, add_bos=add_bos and tok.bos_id is not None)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens=True):
        return self.tokenizer.decode(tokens, skip_special=skip_special_tokens)

    # ---- scoring ----

    @staticmethod
    def _score_rows(rows, cont):
        """(sum of log p(continuation), whether every token was the argmax)."""
        lp = log_softmax(rows)
        return float(lp[np.arange(len(cont)), cont].sum()), bool((lp.argmax(-1) == cont).all())

    def _score_alone(self, ctx, cont):
        """One request by logits_all over context + continuation (less its last
        token), cut on the left to max_length tokens as lm-eval's HF backend does."""
        whole = (list(ctx) + list(cont))[-(self.max_length + 1):]
        inp = whole[:-1]
        n = len(cont)
        return self._score_rows(self.model.logits_all(inp)[len(inp) - n:], np.array(cont))

    def _score_forked(self, ctx, conts):
        """Continuations of one context: the context prefilled once in the
        paged pool, each continuation in a fork of it. The context's last
        logits predict every continuation's first token."""
        m = self.model
        src = m.create_paged_session(ctx, 0)
        try:
            src.prefill_fork_source()
            first = src.last_logits[None, :]
            out = []
            for cont in conts:
                rows = first
                if len(cont) > 1:
                    f = m.create_paged_fork_session(list(ctx) + list(cont[:-1]), 0, src=src,
                                                    prefix_len=len(ctx))
                    try:
                        rows = np.concatenate([first, f._all_logits()])
                    finally:
                        f.release()
                out.append(self._score_rows(rows, np.array(cont)))
            return out
        finally:
            src.release()

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        results = [None] * len(requests)
        groups = {}
        for i, (_, ctx, cont) in enumerate(requests):
            groups.setdefault(tuple(ctx), []).append(i)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="cism loglikelihood")
        for ctx, members in groups.items():
            conts = [requests[i][2] for i in members]
            fits = len(ctx) + max(len(c) for c in conts) <= self.max_length + 1
            if self.fork and fits and len(ctx) > 0 and len(members) > 1:
                scores = self._score_forked(ctx, conts)
            else:
                scores = [self._score_alone(ctx, c) for c in conts]
            for i, s in zip(members, scores):
                results[i] = s
                key = requests[i][0]
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, s)
            bar.update(len(members))
        bar.close()
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        out = []
        for (string,) in tqdm([r.args for r in requests], disable=disable_tqdm, desc="cism rolling"):
            windows = map(lm_utils.make_disjoint_window,
                          lm_utils.get_rolling_token_windows(token_list=self.tok_encode(string),
                                                             prefix_token=self.prefix_token_id,
                                                             max_seq_len=self.max_length, context_len=1))
            total = sum(self._score_alone(ctx, cont)[0] for ctx, cont in windows)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    # ---- generation ----

    def generate_until(self, requests, disable_tqdm=False):
        out = []
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        for context, gen_kwargs in tqdm([r.args for r in requests], disable=disable_tqdm,
                                        desc="cism generate_until"):
            kw = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kw.pop("until", None), eos=eos)
            max_gen_toks = kw.pop("max_gen_toks")
            sample = kw.get("do_sample", False)
            ids = self.tok_encode(context, left_truncate_len=self.max_length - max_gen_toks)
            r = self.model.generate(ids, max_new_tokens=max_gen_toks,
                                    temperature=float(kw.get("temperature", 0.0)) if sample else 0.0,
                                    top_p=float(kw.get("top_p") or 1.0) if sample else 1.0,
                                    top_k=int(kw.get("top_k") or 0) if sample else 0,
                                    seed=self.seed, stop=until)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), r.text)
            out.append(r.text)
        return out


# Registered under the module's import name only: `python -m cism.lm_eval`
# runs this file as __main__ and then imports it as cism.lm_eval (below), and
# lm-eval's registry refuses a second class under one name.
if __name__ != "__main__":
    register_model("cism")(CismLM)


def main(argv=None):
    """lm-eval's command line with the "cism" model registered."""
    from lm_eval.__main__ import cli_evaluate
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    from cism.lm_eval import main as _main   # registers "cism"
    _main()
