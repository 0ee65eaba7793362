"""Byte-level BPE (GPT-2 style): pre-tokenizer regexes, the byte <-> unicode
map, and two encoders that must give identical ids:

- `PyBPE`: pure Python (needs only `regex`), llama.cpp's algorithm;
- `HFBPE`: the same vocabulary and merges run by HF `tokenizers` (much faster).

Both encode one text fragment that holds no special tokens; special-token
splitting and BOS handling live in cism/tokenizers/core.py.
"""
import heapq

from cism.tokenizers.deps import need_regex, need_tokenizers

# ---------------------------------------------------------------------------
# Pre-tokenizers, as llama.cpp's llm_tokenizer_bpe applies them: each regex of
# the list splits every fragment left by the previous one; both the matches and
# the unmatched gaps between them stay fragments (HF: Split(..., "isolated")).
# The patterns are llama.cpp's, which rewrites HF's "(?i:'s|...)" into explicit
# case classes.
# ---------------------------------------------------------------------------
GPT2_RE = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"""
LLAMA3_RE = (r"""(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"""
             r"""[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
             r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_RE = (r"""(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"""
            r"""[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
            r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
BLOOM_RE = r""" ?[^(\s|.,!?…。，、।۔،)]+"""


class PreTokenizer:
    """What `tokenizer.ggml.pre` selects: the split regexes plus two flags that
    llama.cpp ties to the same name."""

    def __init__(self, regexes, ignore_merges=False, add_bos=False):
        self.regexes = tuple(regexes)
        self.ignore_merges = ignore_merges  # a whole word found in the vocab is one token
        self.add_bos = add_bos              # llama.cpp's default when the file does not say


_DEFAULT = PreTokenizer([r"[\p{P}\$\+<=>\^~\|]+", GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"])
_GPT2 = PreTokenizer([GPT2_RE])
_DIGITS_GPT2 = PreTokenizer([r"\p{N}", GPT2_RE])
_QWEN2 = PreTokenizer([QWEN2_RE])
_LLAMA3 = PreTokenizer([LLAMA3_RE], ignore_merges=True, add_bos=True)

# tokenizer.ggml.pre -> pre-tokenizer (llama.cpp's llama_vocab::impl::load).
# gpt-2, smollm, qwen2 and llama-bpe (Llama 3) are checked against reference ids
# in the tests (llama.cpp's vectors, HF tokenizers); the others are transcribed
# from llama.cpp and untested here.
PRE_TOKENIZERS = {
    "default": _DEFAULT,
    "gpt-2": _GPT2, "gpt2": _GPT2, "phi-2": _GPT2, "roberta-bpe": _GPT2, "mpt": _GPT2,
    "olmo": _GPT2, "jais": _GPT2, "jina-es": _GPT2, "jina-de": _GPT2, "gigachat": _GPT2,
    "jina-v1-en": _GPT2, "jina-v2-es": _GPT2, "jina-v2-de": _GPT2, "jina-v2-code": _GPT2,
    "smollm": _DIGITS_GPT2, "starcoder": _DIGITS_GPT2, "refact": _DIGITS_GPT2,
    "command-r": _DIGITS_GPT2, "codeshell": _DIGITS_GPT2, "exaone": _DIGITS_GPT2,
    "minerva-7b": _DIGITS_GPT2,
    "qwen2": _QWEN2, "stablelm2": _QWEN2, "megrez": _QWEN2,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3,
    "dbrx": PreTokenizer([LLAMA3_RE]), "smaug-bpe": PreTokenizer([LLAMA3_RE]),
    "chatglm-bpe": PreTokenizer([LLAMA3_RE]),
    "falcon": PreTokenizer([r"[\p{P}\$\+<=>\^~\|`]+", GPT2_RE, r"[0-9][0-9][0-9]"]),
    "deepseek-coder": PreTokenizer([r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+",
                                    r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"]),
    "bloom": PreTokenizer([BLOOM_RE]), "poro-chat": PreTokenizer([BLOOM_RE]),
    "gpt3-finnish": PreTokenizer([BLOOM_RE]), "viking": PreTokenizer([BLOOM_RE, r"\p{N}"]),
}


def bytes_to_unicode():
    """GPT-2's reversible byte -> printable character map: printable Latin-1
    bytes map to themselves, the other 68 to U+0100 onwards, so every byte
    sequence is a string of visible characters that BPE can work on."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    table = {}
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_CHAR = bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}
# str.translate table: a Latin-1 decoded byte string -> its GPT-2 characters.
_LATIN1_TO_GPT2 = {b: c for b, c in BYTE_TO_CHAR.items()}


def byte_encode(text):
    """UTF-8 encode `text` and spell each byte with its GPT-2 character."""
    return text.encode("utf-8").decode("latin-1").translate(_LATIN1_TO_GPT2)


# str.translate table: GPT-2 character -> the Latin-1 character of its byte.
# Latin-1 characters that are *not* GPT-2 characters (space, controls, NBSP...)
# map to U+FFFF so that encoding to Latin-1 fails and byte_decode falls back.
_GPT2_TO_LATIN1 = {ord(c): chr(b) for c, b in CHAR_TO_BYTE.items()}
for _b in range(256):
    if BYTE_TO_CHAR[_b] != chr(_b):
        _GPT2_TO_LATIN1.setdefault(_b, "\uffff")


def byte_decode(token):
    """Bytes of a byte-level token string. A token with a character outside
    the map (e.g. an added token with non-Latin text) stands for its own UTF-8
    bytes, as in HF's ByteLevel decoder."""
    try:
        return token.translate(_GPT2_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        return token.encode("utf-8")


def split_words(text, compiled):
    """Apply the pre-tokenizer regexes in turn (llama.cpp unicode_regex_split)."""
    words = [text]
    for pattern in compiled:
        out = []
        for w in words:
            start = 0
            for m in pattern.finditer(w):
                if m.start() > start:
                    out.append(w[start:m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                start = m.end()
            if start < len(w):
                out.append(w[start:])
        words = out
    return words


class PyBPE:
    """Pure-Python byte-level BPE, the algorithm of llama.cpp's
    llm_tokenizer_bpe_session: per word, merge the adjacent pair of lowest
    merge rank (leftmost on ties) until no pair has a rank."""

    # Per-word results are cached; words repeat a lot in real text. Bounded so a
    # long-running server cannot grow it without limit.
    CACHE_LIMIT = 1 << 16

    def __init__(self, vocab, merges, pre):
        regex = need_regex()
        self.vocab = vocab                                   # token str -> id
        self.ranks = {pair: i for i, pair in reversed(list(enumerate(merges)))}
        self.pre = pre
        self.compiled = [regex.compile(r) for r in pre.regexes]
        self.cache = {}

    def encode(self, text):
        ids = []
        for word in split_words(text, self.compiled):
            word = byte_encode(word)
            got = self.cache.get(word)
            if got is None:
                got = self._encode_word(word)
                if len(self.cache) >= self.CACHE_LIMIT:
                    self.cache.clear()
                self.cache[word] = got
            ids.extend(got)
        return ids

    def _encode_word(self, word):
        vocab = self.vocab
        if self.pre.ignore_merges and word in vocab:
            return [vocab[word]]
        symbols = self._merge(word)
        ids = []
        for s in symbols:
            tid = vocab.get(s)
            if tid is not None:
                ids.append(tid)
            else:
                # A merge whose result is not in the vocabulary (a broken file):
                # llama.cpp looks up each single byte of the symbol, which only
                # finds ASCII characters, and drops the rest.
                ids.extend(vocab[c] for c in s if c < "\x80" and c in vocab)
        return ids

    def _merge(self, word):
        """Merge with a heap keyed (rank, left position); stale entries are
        recognised by their text, as in llama.cpp. O(n log n) per word, so a long
        run of punctuation or spaces stays fast."""
        n = len(word)
        if n <= 1:
            return [word] if word else []
        text = list(word)            # symbol i's text; "" once merged away
        nxt = list(range(1, n)) + [-1]
        prv = list(range(-1, n - 1))
        ranks = self.ranks
        heap = []
        for i in range(n - 1):
            r = ranks.get((text[i], text[i + 1]))
            if r is not None:
                heap.append((r, i, text[i] + text[i + 1]))
        heapq.heapify(heap)
        while heap:
            r, left, merged = heapq.heappop(heap)
            right = nxt[left]
            if right == -1 or not text[left] or text[left] + text[right] != merged:
                continue  # outdated: one side changed since this pair was queued
            text[left] = merged
            text[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] != -1:
                prv[nxt[right]] = left
            p = prv[left]
            if p != -1:
                r2 = ranks.get((text[p], merged))
                if r2 is not None:
                    heapq.heappush(heap, (r2, p, text[p] + merged))
            q = nxt[left]
            if q != -1:
                r2 = ranks.get((merged, text[q]))
                if r2 is not None:
                    heapq.heappush(heap, (r2, left, merged + text[q]))
        return [t for t in text if t]


class HFBPE:
    """The same byte-level BPE run by HF `tokenizers`: BPE model over the same
    vocab and merges, pre-tokenizer = the same regexes as isolated Splits, then
    ByteLevel without its own regex."""

    def __init__(self, vocab, merges, pre):
        from tokenizers import Regex, Tokenizer, models, pre_tokenizers

        model = models.BPE(vocab=vocab, merges=list(merges), ignore_merges=pre.ignore_merges)
        tok = Tokenizer(model)
        steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
        self.tok = tok

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids


def check_backend(backend):
    if backend not in ("python", "hf"):
        raise ValueError(f"backend must be 'python' or 'hf', got {backend!r}")


def make_bpe(vocab, merges, pre, backend, source):
    # Python is the default: with its word cache it encodes as fast as HF
    # tokenizers on this code's workloads (measured on 2 cores: 3 KB 9 ms vs
    # 8 ms cold; 1.1 MB 0.9-1.5 s vs 1.9-2.0 s) and loads faster, and it is
    # llama.cpp's algorithm by construction. HF is there for comparison.
    if backend == "hf":
        need_tokenizers()
        try:
            return HFBPE(vocab, merges, pre)
        except Exception as e:  # e.g. a merge of tokens missing from the vocabulary
            raise ValueError(f"{source}: HF tokenizers refuses this vocabulary: {e}") from None
    return PyBPE(vocab, merges, pre)
