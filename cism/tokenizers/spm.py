"""SentencePiece-style encoders that need no third-party package:

- `LlamaSPM`: llama.cpp's llm_tokenizer_spm (GGUF `tokenizer.ggml.model=llama`);
- `Llama2cSPM`: llama2.c's run.c `encode()` over a tokenizer.bin vocabulary.

Both greedily merge the adjacent pair whose merged piece has the highest
score, leftmost on ties, but they differ in what they start from: llama.cpp
starts from characters and falls back to <0xXX> byte tokens at the end;
llama2.c starts from per-codepoint token ids (byte tokens up front) and matches
pairs by the concatenation of their vocabulary strings.
"""
import heapq
import math
import re

SPACE_MARK = "\u2581"  # "▁", SentencePiece's visible space
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")   # a byte-fallback token


def piece_bytes(text, byte_fallback=True):
    """Bytes of a SentencePiece token string: "<0xXX>" is that byte, "▁" a space."""
    m = BYTE_TOKEN.fullmatch(text) if byte_fallback else None
    if m:
        return bytes([int(m.group(1), 16)])
    return text.replace(SPACE_MARK, " ").encode("utf-8")

# Both algorithms merge over the whole text at once: SentencePiece has no
# pre-tokenizer. A merge only ever produces a vocabulary token, so where no
# token spans a position, nothing merges across it, and since ties are broken
# by position the merges on either side happen in the same relative order.
# Cutting the text before each space that follows a non-space is therefore
# exact whenever no token holds a non-space followed by a space (true of the
# Llama and TinyStories vocabularies, checked at load time). Then words can be
# cached: 1 MB of text takes ~1 s instead of ~15 s.
_SPM_WORDS = re.compile("\u2581*[^\u2581]+|\u2581+")
_SPM_SPANS = re.compile("[^\u2581]\u2581")
_L2C_WORDS = re.compile(rb" *[^ ]+| +")
_L2C_SPANS = re.compile(rb"[^ ] ")
_CACHE_LIMIT = 1 << 16


def _cached(cache, key, fn):
    got = cache.get(key)
    if got is None:
        got = fn(key)
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[key] = got
    return got


class LlamaSPM:
    """Encode one fragment (no special tokens) like llama.cpp. The caller adds
    the dummy-prefix space; spaces become "▁" here."""

    def __init__(self, tokens, scores, unk_id):
        # token_to_id[word] = i in llama.cpp: a duplicate string maps to its last id.
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.scores = scores
        self.byte_ids = [self._byte_token(b, unk_id) for b in range(256)]
        self.split_words = not any(_SPM_SPANS.search(t) for t in tokens)
        self.cache = {}

    def _byte_token(self, b, unk_id):
        # llama.cpp byte_to_token: "<0xXX>", else the single character, else
        # (our choice; llama.cpp throws) the unknown token.
        tid = self.vocab.get(f"<0x{b:02X}>")
        if tid is None and b < 0x80:
            tid = self.vocab.get(chr(b))
        return unk_id if tid is None else tid

    def encode(self, text):
        text = text.replace(" ", SPACE_MARK)
        if not self.split_words:
            return self._encode(text)
        ids = []
        for m in _SPM_WORDS.finditer(text):
            ids.extend(_cached(self.cache, m.group(), self._encode))
        return ids

    def _encode(self, text):
        n = len(text)
        if n == 0:
            return []
        vocab, scores = self.vocab, self.scores
        sym = list(text)                     # symbol text; "" once merged away
        nxt = list(range(1, n)) + [-1]
        prv = list(range(-1, n - 1))
        # Max-heap on score, then leftmost: key (-score, left). The merged text
        # identifies an entry; it is outdated when the pair no longer spells it.
        heap = []
        for i in range(n - 1):
            tid = vocab.get(sym[i] + sym[i + 1])
            if tid is not None:
                heap.append((-scores[tid], i, sym[i] + sym[i + 1]))
        heapq.heapify(heap)
        while heap:
            _, left, merged = heapq.heappop(heap)
            right = nxt[left]
            if right == -1 or not sym[left] or sym[left] + sym[right] != merged:
                continue
            sym[left] = merged
            sym[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] != -1:
                prv[nxt[right]] = left
            p, q = prv[left], nxt[left]
            if p != -1:
                tid = vocab.get(sym[p] + merged)
                if tid is not None:
                    heapq.heappush(heap, (-scores[tid], p, sym[p] + merged))
            if q != -1:
                tid = vocab.get(merged + sym[q])
                if tid is not None:
                    heapq.heappush(heap, (-scores[tid], left, merged + sym[q]))
        ids = []
        for s in sym:
            if not s:
                continue
            tid = vocab.get(s)
            if tid is not None:
                ids.append(tid)
            else:
                # Only unmerged single characters can miss the vocabulary (every
                # merge produces a token): spell them with byte tokens.
                ids.extend(self.byte_ids[b] for b in s.encode("utf-8"))
        return ids


class Llama2cSPM:
    """llama2.c's encode(): dummy-prefix " " token, per-codepoint lookup with
    byte fallback id = byte + 3, then merges of the best-scoring pair."""

    # run.c starts its search at best_score = -1e10 with a strict ">", so a
    # pair scoring at or below that never merges.
    MIN_SCORE = -1e10

    def __init__(self, pieces, scores):
        # run.c binary-searches a sorted copy of the vocabulary; with duplicate
        # strings any of them may be found. We take the first.
        self.lookup = {}
        for i, p in enumerate(pieces):
            self.lookup.setdefault(p, i)
        self.pieces = pieces
        self.scores = scores
        self.space_id = self.lookup.get(b" ")
        self.split_words = not any(_L2C_SPANS.search(p) for p in pieces)
        self.cache = {}

    def encode(self, data):
        """`data`: UTF-8 bytes of the text."""
        if not data:
            return []
        if self.space_id is None:
            # run.c would emit id -1 for the missing " "; we leave it out.
            return self._encode(data)
        # The dummy prefix is the " " token, exactly what a leading space
        # byte would become, so encode " " + text.
        data = b" " + data
        if not self.split_words:
            return self._encode(data)
        ids = []
        for m in _L2C_WORDS.finditer(data):
            ids.extend(_cached(self.cache, m.group(), self._encode))
        return ids

    def _encode(self, data):
        lookup, pieces, scores = self.lookup, self.pieces, self.scores
        ids = []
        i = 0
        n = len(data)
        while i < n:
            # One codepoint: a lead byte plus its continuation bytes (10xxxxxx),
            # at most 4 bytes as in run.c.
            j = i + 1
            while j < n and (data[j] & 0xC0) == 0x80 and j - i < 4:
                j += 1
            tid = lookup.get(data[i:j])
            if tid is not None:
                ids.append(tid)
            else:
                ids.extend(b + 3 for b in data[i:j])
            i = j
        m = len(ids)
        if m < 2:
            return ids
        nxt = list(range(1, m)) + [-1]
        prv = list(range(-1, m - 1))
        alive = [True] * m

        def pair(left, right):
            tid = lookup.get(pieces[ids[left]] + pieces[ids[right]])
            if tid is None:
                return None
            s = scores[tid]
            if not s > self.MIN_SCORE or math.isnan(s):
                return None
            return (-s, left, ids[left], ids[right], tid)

        heap = [e for e in (pair(k, k + 1) for k in range(m - 1)) if e is not None]
        heapq.heapify(heap)
        while heap:
            _, left, a, b, tid = heapq.heappop(heap)
            right = nxt[left]
            if not alive[left] or right == -1 or ids[left] != a or ids[right] != b:
                continue  # outdated: a neighbour merged since this pair was queued
            ids[left] = tid
            alive[right] = False
            nxt[left] = nxt[right]
            if nxt[right] != -1:
                prv[nxt[right]] = left
            for e in (pair(prv[left], left) if prv[left] != -1 else None,
                      pair(left, nxt[left]) if nxt[left] != -1 else None):
                if e is not None:
                    heapq.heappush(heap, e)
        return [t for t, keep in zip(ids, alive) if keep]
