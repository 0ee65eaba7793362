"""The tokenizer itself, whatever its vocabulary source: special-token
splitting, BOS, encode through the source's encoder, decode through per-token
bytes, streaming, chat templates. The sources (hf_json, gpt2, gguf, llama2c)
build its keyword arguments; cism/tokenizers/__init__.py states the rules
decode keeps."""
import operator
import threading

from cism.tokenizers.stream import HFStreamDecoder, StreamDecoder


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
            return HFStreamDecoder(self, skip_special)
        return StreamDecoder(self, skip_special)

    # ------------------------------------------------------------ chat
    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        """Render `messages` (a list of {"role", "content"} dicts) with the
        model's Jinja chat template the way HF transformers does. Extra keyword
        arguments (tools=..., enable_thinking=...) are passed to the template."""
        if self._chat_template is None:
            raise ValueError(f"this tokenizer has no chat template ({self._source})")
        from cism.tokenizers import chat
        if self._compiled_template is None:
            self._compiled_template = chat.compile_template(self._chat_template)
        variables = {}
        if self._bos_token is not None:
            variables["bos_token"] = self._bos_token
        if self._eos_token is not None:
            variables["eos_token"] = self._eos_token
        variables.update(kwargs)
        return chat.render(self._compiled_template, messages, add_generation_prompt,
                           variables)

    # ------------------------------------------------------------ constructors
    # One function per vocabulary source, each in its own module, returning
    # this class's keyword arguments.
    @classmethod
    def from_file(cls, path):
        """A HF `tokenizer.json`; reads `tokenizer_config.json` (and
        `generation_config.json`, `chat_template.jinja`) next to it."""
        from cism.tokenizers.hf_json import from_tokenizer_json
        return cls(**from_tokenizer_json(path))

    @classmethod
    def from_gpt2_files(cls, encoder_json, vocab_bpe, backend="python"):
        """GPT-2's `encoder.json` + `vocab.bpe` (or HF's `vocab.json` +
        `merges.txt`); `backend` "python" or "hf" (same ids)."""
        from cism.tokenizers.gpt2 import from_gpt2_files
        return cls(**from_gpt2_files(encoder_json, vocab_bpe, backend))

    @classmethod
    def from_gguf(cls, path, backend="python"):
        """The tokenizer in a GGUF file's `tokenizer.ggml.*` metadata;
        `backend` (BPE vocabularies only) "python" or "hf" (same ids)."""
        from cism.tokenizers.gguf import from_gguf
        return cls(**from_gguf(path, backend))

    @classmethod
    def from_llama2c(cls, path, vocab_size=None):
        """A llama2.c `tokenizer.bin`; `vocab_size` (the model's) is checked
        against the token count when given."""
        from cism.tokenizers.llama2c import from_llama2c
        return cls(**from_llama2c(path, vocab_size))

    @classmethod
    def from_pretrained(cls, path):
        """Whichever of the above `path` is: a directory holding one of them, a
        .gguf or tokenizer.json file, or a llama2.c tokenizer or model .bin
        (then the tokenizer next to it whose size matches the model)."""
        from cism.tokenizers.pretrained import from_pretrained
        return cls(**from_pretrained(path))


def _longest_first(pairs):
    return tuple(sorted((p for p in pairs if p[0]), key=lambda p: (-len(p[0]), p[1])))
