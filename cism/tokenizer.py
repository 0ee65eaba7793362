"""Text in, text out: `cism.Tokenizer`.

One class over four vocabulary sources:

| source                                   | encoder                                  |
|------------------------------------------|------------------------------------------|
| HF `tokenizer.json`                      | HF `tokenizers` (required)               |
| GPT-2 `encoder.json` + `vocab.bpe`       | byte-level BPE, pure Python with a word  |
| (or `vocab.json` + `merges.txt`)         | cache (or HF `tokenizers`: backend="hf") |
| GGUF `tokenizer.ggml.model = gpt2`       | same, pre-tokenizer from `.pre`          |
| GGUF `tokenizer.ggml.model = llama`      | llama.cpp's SentencePiece merge, Python  |
| llama2.c `tokenizer.bin`                 | llama2.c run.c `encode()`, Python        |

Decoding never goes through a third-party decoder when the vocabulary is
byte-level or SentencePiece-like: every token id maps to a byte string once, at
load time, and text is those bytes decoded as UTF-8 (invalid sequences become
U+FFFD). The streaming decoder feeds the same bytes through an incremental
UTF-8 decoder, so the concatenation of its output equals `decode()` exactly and
never splits a character.

Two decode rules that keep `decode(encode(text)) == text`:
- SentencePiece vocabularies add a "dummy prefix" space when encoding; decode
  removes one leading space from the first token that produces output, if that
  token is a normal (not special) token. This matches HF's `Strip` decoder.
- No `clean_up_tokenization_spaces` (transformers' " ." -> "." rewrite): it
  would break the round trip.
"""
import codecs
import json
import operator
import re
import struct
import threading
from pathlib import Path

from cism import _tok_deps
from cism._tok_bpe import PRE_TOKENIZERS, HFBPE, PyBPE, byte_decode
from cism._tok_gguf import read_gguf_metadata
from cism._tok_spm import SPACE_MARK, Llama2cSPM, LlamaSPM

__all__ = ["Tokenizer", "StreamDecoder"]

# Token texts llama.cpp treats as end of generation whatever the metadata says
# (llama_vocab::impl::load); chat models stop on them.
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|eom_id|>", "<EOT>")

# GGUF tokenizer.ggml.token_type values (llama.cpp LLAMA_TOKEN_TYPE_*).
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 4, 5, 6

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


# ---------------------------------------------------------------------------
# file helpers: every failure is a ValueError that names the file
# ---------------------------------------------------------------------------
def _read_bytes(path, what):
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{path}: {what} not found") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: expected a {what} file, found a directory") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read {what}: {e.strerror or e}") from None


def _read_text(path, what):
    try:
        return _read_bytes(path, what).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: {what} is not UTF-8 text (byte {e.start})") from None


def _read_json(path, what):
    return _parse_json(_read_text(path, what), path, what)


def _parse_json(text, path, what):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON in {what}: {e.msg} "
                         f"(line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise ValueError(f"{path}: invalid JSON in {what}: nested too deeply") from None


def _expect(cond, path, msg):
    if not cond:
        raise ValueError(f"{path}: {msg}")


def _token_content(value):
    """A special token as tokenizer_config.json spells it: a string, or an
    AddedToken dict {"content": ...}; None when unset."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_chat_template(value):
    """tokenizer_config's chat_template: a string, or a list of
    {"name", "template"} of which HF uses "default"."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        tpl = named.get("default")
        return tpl if isinstance(tpl, str) else None
    return None


def _read_hf_config(directory):
    """Settings from the HF files next to a tokenizer: tokenizer_config.json,
    chat_template.jinja and generation_config.json (all optional)."""
    d = Path(directory)
    cfg = {}
    p = d / "tokenizer_config.json"
    if p.exists():
        data = _read_json(p, "tokenizer_config.json")
        _expect(isinstance(data, dict), p, "tokenizer_config.json must hold a JSON object")
        cfg = data
    out = {
        "bos_token": _token_content(cfg.get("bos_token")),
        "eos_token": _token_content(cfg.get("eos_token")),
        "add_bos": cfg.get("add_bos_token") if isinstance(cfg.get("add_bos_token"), bool) else None,
        "chat_template": _pick_chat_template(cfg.get("chat_template")),
        "added_tokens": {},
        "eos_ids": [],
    }
    added = cfg.get("added_tokens_decoder")
    if isinstance(added, dict):
        for k, v in added.items():
            if str(k).isdigit() and isinstance(v, dict) and isinstance(v.get("content"), str):
                out["added_tokens"][int(k)] = (v["content"], bool(v.get("special", False)))
    jinja = d / "chat_template.jinja"
    if out["chat_template"] is None and jinja.exists():
        out["chat_template"] = _read_text(jinja, "chat_template.jinja")
    gen = d / "generation_config.json"
    if gen.exists():
        data = _read_json(gen, "generation_config.json")
        eos = data.get("eos_token_id") if isinstance(data, dict) else None
        eos = eos if isinstance(eos, list) else [eos]
        out["eos_ids"] = [e for e in eos if isinstance(e, int) and not isinstance(e, bool)]
    return out


# ---------------------------------------------------------------------------
# decoding: per-token bytes
# ---------------------------------------------------------------------------
def _spm_piece(text, byte_fallback=True):
    """Bytes of a SentencePiece token string: "<0xXX>" is that byte, "▁" a space."""
    m = _BYTE_TOKEN.fullmatch(text) if byte_fallback else None
    if m:
        return bytes([int(m.group(1), 16)])
    return text.replace(SPACE_MARK, " ").encode("utf-8")


def _flatten_decoders(dec):
    if not isinstance(dec, dict):
        return []
    if dec.get("type") == "Sequence":
        out = []
        for d in dec.get("decoders") or []:
            out.extend(_flatten_decoders(d))
        return out
    return [dec]


def _hf_decode_rule(decoder):
    """How a tokenizer.json `decoder` turns tokens into bytes, for the two
    families reproduced here: ("bytelevel", False, False) or
    ("spm", strip_first_space, byte_fallback) for Llama-style
    Replace("▁", " ") + ByteFallback + Fuse + Strip(" ", 1, 0). None for
    anything else, which is then decoded by HF itself. (HF's Metaspace decoder
    drops *every* "▁" of the first token, which no byte mapping reproduces.)"""
    steps = _flatten_decoders(decoder)
    types = [d.get("type") for d in steps]
    if types == ["ByteLevel"]:
        return ("bytelevel", False, False)
    if types and set(types) <= {"Replace", "ByteFallback", "Fuse", "Strip"} and "Replace" in types:
        for d in steps:
            if d["type"] == "Replace":
                pattern = d.get("pattern") or {}
                if pattern.get("String") != SPACE_MARK or d.get("content") != " ":
                    return None
            if d["type"] == "Strip" and (d.get("content") != " " or d.get("stop", 0) != 0
                                         or d.get("start", 0) > 1):
                return None
        strip = any(d["type"] == "Strip" and d.get("start", 0) == 1 for d in steps)
        return ("spm", strip, "ByteFallback" in types)
    return None


# ---------------------------------------------------------------------------
# the tokenizer
# ---------------------------------------------------------------------------
class Tokenizer:
    """Text <-> token ids for a language model. Build one with a `from_*`
    classmethod or `Tokenizer.from_pretrained(path)`."""

    def __init__(self, *, kind, tokens, pieces, special_ids, bos_id, eos_ids, add_bos,
                 strip_space=False, specials=(), user_specials=(), encoder=None, hf=None,
                 chat_template=None, bos_token=None, eos_token=None, source=""):
        self._kind = kind                 # "hf", "bpe", "spm", "llama2c"
        self._tokens = tokens             # id -> token string (None for a gap)
        self._token_ids = None            # token string -> id, built on first use
        self._pieces = pieces             # id -> bytes, or None: decode through HF
        self._special_ids = frozenset(special_ids)  # skipped by skip_special
        self._bos_id = bos_id
        self._eos_ids = tuple(dict.fromkeys(eos_ids))
        self._add_bos = bool(add_bos)
        # SentencePiece's dummy prefix: encode adds a space in front of the text
        # (and after each special token), decode removes one leading space.
        self._strip_space = strip_space
        # Special tokens cut out of raw text, as (text, id), longest first then
        # by id (llama.cpp's order). Control tokens only when parse_special,
        # user-defined ones always (llama.cpp, and HF for its added tokens).
        self._specials_always = _longest_first(user_specials)
        self._specials_parsed = _longest_first(list(specials) + list(user_specials))
        self._encoder = encoder
        self._hf = hf
        # HF parses special tokens unless `encode_special_tokens` is set; the
        # flag lives on the shared object, so flipping it and encoding happen
        # under one lock.
        self._hf_lock = threading.Lock()
        self._chat_template = chat_template
        self._compiled_template = None
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._source = str(source)

    def __repr__(self):
        return (f"Tokenizer(kind={self._kind!r}, vocab_size={self.vocab_size}, "
                f"bos_id={self._bos_id}, eos_ids={self._eos_ids}, source={self._source!r})")

    # ------------------------------------------------------------ properties
    @property
    def vocab_size(self):
        return len(self._tokens)

    @property
    def bos_id(self):
        """The BOS token id, or None when the vocabulary has none."""
        return self._bos_id

    @property
    def eos_ids(self):
        """Every id that ends generation: the EOS token first, then end-of-turn
        tokens the metadata names (e.g. <|im_end|>, <|endoftext|>)."""
        return self._eos_ids

    @property
    def add_bos(self):
        """Whether encode() prepends BOS by default."""
        return self._add_bos

    @property
    def has_chat_template(self):
        return self._chat_template is not None

    @property
    def chat_template(self):
        return self._chat_template

    # ------------------------------------------------------------ vocabulary
    def _check_id(self, token_id):
        try:
            i = operator.index(token_id)
        except TypeError:
            raise TypeError(f"token ids must be integers, got {type(token_id).__name__}") from None
        if not 0 <= i < len(self._tokens):
            raise ValueError(f"token id {i} is out of range [0, {len(self._tokens)})")
        if self._tokens[i] is None:
            raise ValueError(f"token id {i} is not in the vocabulary (a gap in its ids)")
        return i

    def id_to_token(self, token_id):
        """The vocabulary string of `token_id` (e.g. "Ġthe", "▁the")."""
        return self._tokens[self._check_id(token_id)]

    def token_to_id(self, token):
        """The id of the vocabulary string `token`, or None if absent."""
        if self._token_ids is None:
            ids = {}
            for i, t in enumerate(self._tokens):
                if t is not None:
                    ids.setdefault(t, i)
            self._token_ids = ids
        return self._token_ids.get(token)

    # ------------------------------------------------------------ encoding
    def encode(self, text, add_bos=None, parse_special=True):
        """Token ids of `text`. `add_bos` None uses the tokenizer's default.
        `parse_special`: spell special tokens written in the text (e.g. the
        "<|im_start|>" of a rendered chat template) as their single ids; False
        encodes them as plain text."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        add_bos = self._add_bos if add_bos is None else bool(add_bos)
        ids = []
        if add_bos:
            if self._bos_id is None:
                raise ValueError("add_bos=True but this tokenizer has no BOS token")
            ids.append(self._bos_id)
        if self._kind == "hf":
            with self._hf_lock:
                self._hf.encode_special_tokens = not parse_special
                try:
                    ids.extend(self._hf.encode(text, add_special_tokens=False).ids)
                except Exception as e:  # the Rust side raises a bare Exception
                    # e.g. a character outside a vocabulary that has no unk token
                    raise ValueError(f"{self._source}: cannot encode this text: {e}") from None
        elif self._kind == "llama2c":
            ids.extend(self._encoder.encode(text.encode("utf-8")))
        else:
            # After BOS or a special token a SentencePiece fragment gets the
            # dummy-prefix space again (llama.cpp: is_prev_special).
            after_special = True
            for frag in self._split_specials(text, parse_special):
                if isinstance(frag, int):
                    ids.append(frag)
                    after_special = True
                    continue
                if self._kind == "spm" and self._strip_space and after_special:
                    frag = " " + frag
                ids.extend(self._encoder.encode(frag))
                after_special = False
        return ids

    def _split_specials(self, text, parse_special):
        """llama.cpp's tokenizer_st_partition: for each special token, longest
        first, cut it out of every remaining text fragment. Returns a list of
        str fragments and int ids."""
        frags = [text] if text else []
        for s, tid in self._specials_parsed if parse_special else self._specials_always:
            if s not in text:
                continue
            out = []
            for f in frags:
                if isinstance(f, int) or s not in f:
                    out.append(f)
                    continue
                for k, part in enumerate(f.split(s)):
                    if k:
                        out.append(tid)
                    if part:
                        out.append(part)
            frags = out
        return frags

    # ------------------------------------------------------------ decoding
    def _piece(self, token_id, skip_special, started):
        """Bytes token `token_id` contributes, and the new `started` flag
        (True once any output was produced)."""
        i = self._check_id(token_id)
        special = i in self._special_ids
        if special and skip_special:
            return b"", started
        piece = self._pieces[i]
        if not started and piece:
            if self._strip_space and not special and piece[:1] == b" ":
                piece = piece[1:]
            started = True
        return piece, started

    def decode(self, ids, skip_special=False):
        """Text of `ids`; `skip_special` drops control tokens (BOS, EOS, <|im_end|>...).
        Raises ValueError on an id outside the vocabulary."""
        if self._pieces is None:
            return self._hf_decode(ids, skip_special)
        out = []
        started = False
        for t in ids:
            piece, started = self._piece(t, skip_special, started)
            out.append(piece)
        return b"".join(out).decode("utf-8", errors="replace")

    def _hf_decode(self, ids, skip_special):
        ids = [self._check_id(t) for t in ids]
        return self._hf.decode(ids, skip_special_tokens=skip_special)

    def token_bytes(self, token_id):
        """The bytes token `token_id` stands for (its piece; a special token's
        name), as OpenAI's logprobs report them."""
        i = self._check_id(token_id)
        if i in self._special_ids:
            return self._tokens[i].encode("utf-8")
        if self._pieces is None:
            return self._hf_decode([i], False).encode("utf-8")
        return self._pieces[i]

    def stream_decoder(self, skip_special=True):
        """A StreamDecoder: push ids one at a time, get text as soon as it is
        complete UTF-8."""
        if self._pieces is None:
            return _HFStreamDecoder(self, skip_special)
        return StreamDecoder(self, skip_special)

    # ------------------------------------------------------------ chat
    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        """Render `messages` (a list of {"role", "content"} dicts) with the
        model's Jinja chat template the way HF transformers does. Extra keyword
        arguments (tools=..., enable_thinking=...) are passed to the template."""
        if self._chat_template is None:
            raise ValueError(f"this tokenizer has no chat template ({self._source})")
        from cism import _tok_chat
        if self._compiled_template is None:
            self._compiled_template = _tok_chat.compile_template(self._chat_template)
        variables = {}
        if self._bos_token is not None:
            variables["bos_token"] = self._bos_token
        if self._eos_token is not None:
            variables["eos_token"] = self._eos_token
        variables.update(kwargs)
        return _tok_chat.render(self._compiled_template, messages, add_generation_prompt,
                                variables)

    # ------------------------------------------------------------ constructors
    @classmethod
    def from_file(cls, path):
        """A HF `tokenizer.json`; reads `tokenizer_config.json` (and
        `generation_config.json`, `chat_template.jinja`) next to it."""
        tokenizers = _tok_deps.need_tokenizers()
        path = Path(path)
        raw = _read_text(path, "tokenizer.json")
        data = _parse_json(raw, path, "tokenizer.json")
        _check_tokenizer_json(data, path)
        try:
            hf = tokenizers.Tokenizer.from_str(raw)
        except Exception as e:  # the Rust side raises a bare Exception
            raise ValueError(f"{path}: not a valid tokenizer.json: {e}") from None

        vocab = hf.get_vocab(with_added_tokens=True)
        n = max(vocab.values(), default=-1) + 1
        tokens = [None] * n
        for t, i in vocab.items():
            tokens[i] = t
        added = [a for a in data.get("added_tokens") or [] if 0 <= a["id"] < n]
        special_ids = {a["id"] for a in added if a.get("special")}

        rule = _hf_decode_rule(data.get("decoder"))
        pieces, strip = None, False
        if rule is not None:
            # HF runs added tokens through the same decoder as the others.
            kind, strip, byte_fallback = rule
            if kind == "bytelevel":
                pieces = [b"" if t is None else byte_decode(t) for t in tokens]
            else:
                pieces = [b"" if t is None else _spm_piece(t, byte_fallback) for t in tokens]

        cfg = _read_hf_config(path.parent)
        bos_id = _id_of(vocab, cfg["bos_token"])
        eos_id = _id_of(vocab, cfg["eos_token"])
        add_bos = cfg["add_bos"]
        if add_bos is None:
            # No explicit setting: BOS is added when the post-processor adds a
            # token in front (e.g. Llama's TemplateProcessing).
            try:
                plain = hf.encode("a", add_special_tokens=False).ids
                full = hf.encode("a", add_special_tokens=True).ids
            except Exception:  # "a" is not in a vocabulary without an unk token
                plain = full = []
            add_bos = len(full) > len(plain) and full[1:len(plain) + 1] == plain
            if add_bos and bos_id is None:
                bos_id = full[0]
        if add_bos and bos_id is None:
            add_bos = False
        eos_ids = _eos_list(eos_id, cfg["eos_ids"], tokens, special_ids, n)
        return cls(kind="hf", tokens=tokens, pieces=pieces, special_ids=special_ids,
                   bos_id=bos_id, eos_ids=eos_ids, add_bos=add_bos, strip_space=strip, hf=hf,
                   chat_template=cfg["chat_template"],
                   bos_token=cfg["bos_token"] or (tokens[bos_id] if bos_id is not None else None),
                   eos_token=cfg["eos_token"] or (tokens[eos_id] if eos_id is not None else None),
                   source=path)

    @classmethod
    def from_gpt2_files(cls, encoder_json, vocab_bpe, backend="python"):
        """GPT-2's `encoder.json` + `vocab.bpe` (or HF's `vocab.json` +
        `merges.txt`): byte-level BPE with the GPT-2 pre-tokenizer. A
        `tokenizer_config.json` next to them adds special tokens, BOS/EOS and
        the chat template. `backend`: "python" or "hf" (HF tokenizers runs
        the same vocabulary); both give the same ids."""
        _check_backend(backend)
        encoder_json, vocab_bpe = Path(encoder_json), Path(vocab_bpe)
        vocab = _read_json(encoder_json, "vocabulary JSON")
        _expect(isinstance(vocab, dict) and vocab, encoder_json,
                "the vocabulary must be a non-empty JSON object mapping token -> id")
        bad = next((t for t, i in vocab.items() if type(i) is not int or not 0 <= i < 1 << 24),
                   None)
        _expect(bad is None, encoder_json, f"token {bad!r} has id {vocab.get(bad)!r}; "
                                           "ids must be non-negative integers")
        merges = _parse_merges(_read_text(vocab_bpe, "merges file"), vocab_bpe)

        cfg = _read_hf_config(encoder_json.parent)
        n = max(vocab.values()) + 1
        for i, (content, _) in cfg["added_tokens"].items():
            n = max(n, i + 1)
        tokens = [None] * n
        for t, i in vocab.items():
            tokens[i] = t
        # Added tokens are raw text, not byte-level spellings; the special ones
        # are parsed only with parse_special, the others always (as in HF).
        special_ids = {i for i, (_, special) in cfg["added_tokens"].items() if special}
        if "<|endoftext|>" in vocab:
            special_ids.add(vocab["<|endoftext|>"])
        for i, (content, _) in cfg["added_tokens"].items():
            tokens[i] = content
        added_ids = set(cfg["added_tokens"]) | special_ids
        pieces = [b"" if t is None else t.encode("utf-8") if i in added_ids else byte_decode(t)
                  for i, t in enumerate(tokens)]

        ids_by_text = {t: i for i, t in enumerate(tokens) if t is not None}
        bos_token = cfg["bos_token"] or ("<|endoftext|>" if "<|endoftext|>" in vocab else None)
        eos_token = cfg["eos_token"] or ("<|endoftext|>" if "<|endoftext|>" in vocab else None)
        bos_id, eos_id = _id_of(ids_by_text, bos_token), _id_of(ids_by_text, eos_token)
        encoder = _make_bpe(vocab, merges, PRE_TOKENIZERS["gpt-2"], backend, vocab_bpe)
        return cls(kind="bpe", tokens=tokens, pieces=pieces, special_ids=special_ids,
                   bos_id=bos_id, eos_ids=_eos_list(eos_id, cfg["eos_ids"], tokens, special_ids, n),
                   add_bos=bool(cfg["add_bos"]) and bos_id is not None,
                   specials=[(tokens[i], i) for i in special_ids],
                   user_specials=[(tokens[i], i) for i in added_ids - special_ids],
                   encoder=encoder, chat_template=cfg["chat_template"],
                   bos_token=bos_token, eos_token=eos_token, source=encoder_json)

    @classmethod
    def from_gguf(cls, path, backend="python"):
        """The tokenizer stored in a GGUF file's `tokenizer.ggml.*` metadata.
        `backend` (BPE vocabularies only): "python" or "hf", same ids."""
        _check_backend(backend)
        path = Path(path)
        meta = read_gguf_metadata(path)

        def get(key, types, default=None, required=False):
            if key not in meta:
                _expect(not required, path, f"GGUF metadata has no {key}")
                return default
            v = meta[key]
            _expect(isinstance(v, types) and not (isinstance(v, bool) and bool not in types),
                    path, f"GGUF {key} has the wrong type ({type(v).__name__})")
            return v

        def get_list(key, elem, label, n=None, required=False):
            v = get(key, (list,), None, required)
            if v is None:
                return None
            _expect(all(isinstance(x, elem) for x in v), path, f"GGUF {key} must be a list of {label}")
            _expect(n is None or len(v) == n, path,
                    f"GGUF {key} has {len(v)} entries, tokenizer.ggml.tokens has {n}")
            return v

        model = get("tokenizer.ggml.model", (str,), required=True)
        tokens = get_list("tokenizer.ggml.tokens", str, "strings", required=True)
        n = len(tokens)
        _expect(n > 0, path, "GGUF tokenizer.ggml.tokens is empty")
        types = get_list("tokenizer.ggml.token_type", int, "integers", n) or [_TT_NORMAL] * n
        # llama.cpp renames empty tokens so they can be looked up
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]

        def token_id(key, default):
            v = get(key, (int,), default)
            if v is not None:
                _expect(0 <= v < n, path, f"GGUF {key} = {v} is outside the vocabulary (size {n})")
            return v

        if model == "gpt2":
            merges_raw = get_list("tokenizer.ggml.merges", str, "strings", required=True)
            merges = []
            for k, m in enumerate(merges_raw):
                # llama.cpp splits at the first space after the first character
                pos = m.find(" ", 1)
                _expect(pos > 0, path,
                        f"GGUF tokenizer.ggml.merges[{k}] = {m!r} is not 'left right'")
                merges.append((m[:pos], m[pos + 1:]))
            pre_name = get("tokenizer.ggml.pre", (str,), "default")
            pre = PRE_TOKENIZERS.get(pre_name)
            known = ", ".join(sorted(PRE_TOKENIZERS))
            _expect(pre is not None, path,
                    f"unsupported tokenizer.ggml.pre {pre_name!r} (known: {known})")
            vocab = {t: i for i, t in enumerate(tokens)}
            encoder = _make_bpe(vocab, merges, pre, backend, path)
            kind, strip, add_bos_default = "bpe", False, pre.add_bos
            pieces = [t.encode("utf-8") if ty in (_TT_UNKNOWN, _TT_CONTROL, _TT_USER)
                      else byte_decode(t) for t, ty in zip(tokens, types)]
            bos_default = eos_default = None
        elif model == "llama":
            scores = get_list("tokenizer.ggml.scores", (int, float), "numbers", n) or [0.0] * n
            if "tokenizer.ggml.token_type" not in meta:
                types = [_TT_BYTE if _BYTE_TOKEN.fullmatch(t) else _TT_NORMAL for t in tokens]
            unk_id = token_id("tokenizer.ggml.unknown_token_id", 0)
            encoder = LlamaSPM(tokens, [float(s) for s in scores], unk_id)
            kind, add_bos_default = "spm", True
            strip = get("tokenizer.ggml.add_space_prefix", (bool,), True)
            pieces = []
            for t, ty in zip(tokens, types):
                if ty == _TT_BYTE and _BYTE_TOKEN.fullmatch(t):
                    pieces.append(_spm_piece(t))
                elif ty in (_TT_UNKNOWN, _TT_CONTROL, _TT_USER):
                    pieces.append(t.encode("utf-8"))
                else:
                    pieces.append(t.replace(SPACE_MARK, " ").encode("utf-8"))
            bos_default, eos_default = (1, 2) if n > 2 else (None, None)
        else:
            raise ValueError(f"{path}: unsupported tokenizer.ggml.model {model!r} "
                             "(supported: 'gpt2', 'llama')")

        special_ids = {i for i, ty in enumerate(types) if ty in (_TT_UNKNOWN, _TT_CONTROL)}
        specials = [(tokens[i], i) for i in special_ids]
        user_specials = [(t, i) for i, (t, ty) in enumerate(zip(tokens, types)) if ty == _TT_USER]
        bos_id = token_id("tokenizer.ggml.bos_token_id", bos_default)
        eos_id = token_id("tokenizer.ggml.eos_token_id", eos_default)
        extra_eos = [token_id(k, None) for k in ("tokenizer.ggml.eot_token_id",
                                                  "tokenizer.ggml.eom_token_id")]
        add_bos = get("tokenizer.ggml.add_bos_token", (bool,), add_bos_default)
        template = get("tokenizer.chat_template", (str,), None)
        return cls(kind=kind, tokens=tokens, pieces=pieces, special_ids=special_ids,
                   bos_id=bos_id,
                   eos_ids=_eos_list(eos_id, [e for e in extra_eos if e is not None], tokens,
                                     special_ids | {i for _, i in user_specials}, n),
                   add_bos=add_bos and bos_id is not None, strip_space=strip, specials=specials,
                   user_specials=user_specials, encoder=encoder, chat_template=template,
                   bos_token=tokens[bos_id] if bos_id is not None else None,
                   eos_token=tokens[eos_id] if eos_id is not None else None, source=path)

    @classmethod
    def from_llama2c(cls, path, vocab_size=None):
        """A llama2.c `tokenizer.bin`: int32 max_token_length, then per token
        float32 score, int32 length, bytes. The token count is whatever the
        file holds; pass `vocab_size` (the model's) to check it. BOS=1, EOS=2,
        encode prepends BOS by default (as run.c does for prompts)."""
        path = Path(path)
        data = _read_bytes(path, "llama2.c tokenizer")
        _expect(len(data) >= 4, path, "truncated llama2.c tokenizer: no header")
        (max_len,) = struct.unpack_from("<i", data, 0)
        _expect(0 < max_len <= 1 << 16, path,
                f"not a llama2.c tokenizer: max_token_length {max_len} is implausible")
        pieces, scores = [], []
        off = 4
        while off < len(data):
            i = len(pieces)
            _expect(off + 8 <= len(data), path, f"truncated llama2.c tokenizer inside token {i}")
            score, length = struct.unpack_from("<fi", data, off)
            off += 8
            _expect(0 <= length <= max_len, path,
                    f"corrupt llama2.c tokenizer: token {i} has length {length} "
                    f"(max_token_length is {max_len})")
            _expect(off + length <= len(data), path,
                    f"truncated llama2.c tokenizer inside token {i}")
            pieces.append(data[off:off + length])
            scores.append(score)
            off += length
        n = len(pieces)
        # Ids 0-2 are <unk>, <s>, </s> and 3-258 the byte tokens (run.c's +3).
        _expect(n >= 259, path, f"llama2.c tokenizer has {n} tokens; needs at least 259 "
                                "(3 specials + 256 byte tokens)")
        if vocab_size is not None:
            _expect(n == vocab_size, path,
                    f"llama2.c tokenizer has {n} tokens but the model's vocab_size is {vocab_size}")
        # llama2.c's exporter writes BOS/EOS as "\n<s>\n" / "\n</s>\n".
        tokens = [p.decode("utf-8", errors="replace") for p in pieces]
        tokens[:3] = [t.strip() for t in tokens[:3]]
        out_pieces = []
        for i, p in enumerate(pieces):
            m = _BYTE_TOKEN.fullmatch(tokens[i])
            if i < 3:
                out_pieces.append(tokens[i].encode("utf-8"))
            elif m:
                out_pieces.append(bytes([int(m.group(1), 16)]))
            else:
                out_pieces.append(p)
        return cls(kind="llama2c", tokens=tokens, pieces=out_pieces, special_ids={0, 1, 2},
                   bos_id=1, eos_ids=[2], add_bos=True, strip_space=True,
                   encoder=Llama2cSPM(pieces, scores), bos_token="<s>", eos_token="</s>",
                   source=path)

    @classmethod
    def from_pretrained(cls, path):
        """Pick the right constructor for `path`:
        - a directory with tokenizer.json, encoder.json + vocab.bpe,
          vocab.json + merges.txt, one .gguf file, or a llama2.c tokenizer.bin;
        - a .gguf file; a tokenizer.json file;
        - a llama2.c tokenizer (tokenizer.bin, tok*.bin) or model .bin, for
          which the tokenizer next to it whose size matches the model is used."""
        p = Path(path)
        if p.is_dir():
            if (p / "tokenizer.json").is_file():
                return cls.from_file(p / "tokenizer.json")
            for enc, mer in (("encoder.json", "vocab.bpe"), ("vocab.json", "merges.txt")):
                if (p / enc).is_file() and (p / mer).is_file():
                    return cls.from_gpt2_files(p / enc, p / mer)
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) == 1:
                return cls.from_gguf(ggufs[0])
            bins = _llama2c_tokenizers(p)
            if len(ggufs) == 0 and bins:
                return cls.from_llama2c(bins[0])
            raise ValueError(f"{p}: no tokenizer found (looked for tokenizer.json, "
                             "encoder.json+vocab.bpe, vocab.json+merges.txt, one *.gguf, "
                             f"tokenizer.bin/tok*.bin){'; several .gguf files' if ggufs else ''}")
        if not p.exists():
            raise ValueError(f"{p}: no such file or directory")
        if p.suffix == ".gguf" or _has_magic(p, b"GGUF"):
            return cls.from_gguf(p)
        if p.suffix == ".json":
            return cls.from_file(p)
        if p.suffix == ".bin":
            if p.name.startswith("tok"):
                return cls.from_llama2c(p)
            vocab_size = _llama2c_model_vocab(p)
            candidates = [b for b in _llama2c_tokenizers(p.parent) if b != p]
            for b in candidates:
                if vocab_size is None or _llama2c_count(b) == vocab_size:
                    return cls.from_llama2c(b, vocab_size=vocab_size)
            raise ValueError(f"{p}: no llama2.c tokenizer (tokenizer.bin or tok*.bin) "
                             f"with {vocab_size} tokens next to this model")
        raise ValueError(f"{p}: cannot tell which tokenizer format this file is "
                         "(expected .gguf, tokenizer.json or a llama2.c .bin)")


# ---------------------------------------------------------------------------
# streaming
# ---------------------------------------------------------------------------
class StreamDecoder:
    """Incremental decode: `push(id)` returns the text that became complete,
    `flush()` the rest (incomplete UTF-8 becomes U+FFFD, as in decode()) and
    resets the decoder for a new sequence. The concatenation of all pushes and
    the flush equals `tok.decode(ids, skip_special)`."""

    def __init__(self, tokenizer, skip_special=True):
        self._tok = tokenizer
        self._skip_special = skip_special
        self._reset()

    def _reset(self):
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._started = False

    def push(self, token_id):
        piece, self._started = self._tok._piece(token_id, self._skip_special, self._started)
        return self._utf8.decode(piece)

    def flush(self):
        text = self._utf8.decode(b"", final=True)
        self._reset()
        return text


class _HFStreamDecoder:
    """Fallback for tokenizer.json decoders we do not reproduce: re-decode the
    whole sequence through HF and emit the new suffix once it no longer ends in
    U+FFFD. Quadratic in the sequence length, and exact only for decoders whose
    output for a prefix is a prefix of the output for the whole."""

    def __init__(self, tokenizer, skip_special=True):
        self._tok = tokenizer
        self._skip_special = skip_special
        self._ids = []
        self._emitted = 0

    def push(self, token_id):
        self._ids.append(self._tok._check_id(token_id))
        text = self._tok._hf_decode(self._ids, self._skip_special)
        if text.endswith("\ufffd") or len(text) <= self._emitted:
            return ""
        new = text[self._emitted:]
        self._emitted = len(text)
        return new

    def flush(self):
        text = self._tok._hf_decode(self._ids, self._skip_special)
        new = text[self._emitted:]
        self._ids, self._emitted = [], 0
        return new


# ---------------------------------------------------------------------------
# helpers for the constructors
# ---------------------------------------------------------------------------
def _check_tokenizer_json(data, path):
    """The structure checks that give a clear message before HF's own parser
    reports something cryptic."""
    _expect(isinstance(data, dict), path, "tokenizer.json must hold a JSON object")
    model = data.get("model")
    _expect(isinstance(model, dict), path, "tokenizer.json has no 'model' object")
    mtype = model.get("type", "BPE" if "merges" in model else None)
    if mtype == "BPE":
        vocab = model.get("vocab")
        _expect(isinstance(vocab, dict), path,
                "'model.vocab' must be an object mapping token -> id")
        bad = next((t for t, i in vocab.items() if type(i) is not int or i < 0), None)
        _expect(bad is None, path, f"'model.vocab' entry {bad!r} has id {vocab.get(bad)!r}; "
                                   "ids must be non-negative integers")
        _expect("merges" in model, path, "BPE model has no 'model.merges'")
        merges = model["merges"]
        _expect(isinstance(merges, list), path, "'model.merges' must be a list")
        bad = next((k for k, m in enumerate(merges) if not (
            (type(m) is str and " " in m[1:])
            or (type(m) is list and len(m) == 2 and type(m[0]) is str and type(m[1]) is str))),
            None)
        _expect(bad is None, path,
                f"'model.merges'[{bad}] = {merges[bad] if bad is not None else None!r} "
                "is neither 'a b' nor ['a', 'b']")
    added = data.get("added_tokens", [])
    _expect(isinstance(added, list), path, "'added_tokens' must be a list")
    for k, a in enumerate(added):
        _expect(isinstance(a, dict) and isinstance(a.get("id"), int)
                and isinstance(a.get("content"), str), path,
                f"'added_tokens'[{k}] must be an object with an integer 'id' "
                "and a string 'content'")


def _parse_merges(text, path):
    """vocab.bpe / merges.txt: an optional "#version" line, then "left right"."""
    merges = []
    for k, line in enumerate(text.split("\n"), start=1):
        line = line.rstrip("\r")
        if not line or (k == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        _expect(len(parts) == 2 and all(parts), path,
                f"line {k}: expected two tokens separated by one space, got {line!r}")
        merges.append((parts[0], parts[1]))
    _expect(merges, path, "no merges in the merges file")
    return merges


def _check_backend(backend):
    if backend not in ("python", "hf"):
        raise ValueError(f"backend must be 'python' or 'hf', got {backend!r}")


def _make_bpe(vocab, merges, pre, backend, source):
    # Python is the default: with its word cache it encodes as fast as HF
    # tokenizers on this code's workloads (measured on 2 cores: 3 KB 9 ms vs
    # 8 ms cold; 1.1 MB 0.9-1.5 s vs 1.9-2.0 s) and loads faster, and it is
    # llama.cpp's algorithm by construction. HF is there for comparison.
    if backend == "hf":
        _tok_deps.need_tokenizers()
        try:
            return HFBPE(vocab, merges, pre)
        except Exception as e:  # e.g. a merge of tokens missing from the vocabulary
            raise ValueError(f"{source}: HF tokenizers refuses this vocabulary: {e}") from None
    return PyBPE(vocab, merges, pre)


def _longest_first(pairs):
    return tuple(sorted((p for p in pairs if p[0]), key=lambda p: (-len(p[0]), p[1])))


def _id_of(vocab, token):
    return None if token is None else vocab.get(token)


def _eos_list(eos_id, extra, tokens, special_ids, n):
    ids = [eos_id] if eos_id is not None else []
    ids += [e for e in extra if 0 <= e < n]
    ids += [i for i in sorted(special_ids) if tokens[i] in _EOG_TEXTS]
    return ids


def _has_magic(path, magic):
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False


def _llama2c_tokenizers(directory):
    d = Path(directory)
    out = [d / "tokenizer.bin"] if (d / "tokenizer.bin").is_file() else []
    out += sorted(p for p in d.glob("tok*.bin") if p.is_file() and p.name != "tokenizer.bin")
    return out


def _llama2c_model_vocab(path):
    """vocab_size from a llama2.c model header (7 int32: dim, hidden_dim,
    n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a negative vocab_size
    means an untied classifier)."""
    try:
        with open(path, "rb") as f:
            head = f.read(28)
    except OSError as e:
        raise ValueError(f"{path}: cannot read llama2.c model: {e.strerror or e}") from None
    _expect(len(head) == 28, path, "truncated llama2.c model header")
    return abs(struct.unpack("<7i", head)[5])


def _llama2c_count(path):
    """Token count of a llama2.c tokenizer file, or None if it does not parse."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    off, n = 4, 0
    while off + 8 <= len(data):
        (length,) = struct.unpack_from("<i", data, off + 4)
        if length < 0:
            return None
        off += 8 + length
        n += 1
    return n if off == len(data) else None
