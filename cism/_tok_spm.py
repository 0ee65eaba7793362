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

SPACE_MARK = "\u2581"  # "▁", SentencePiece's visible space


class LlamaSPM:
    """Encode one fragment (no special tokens) like llama.cpp. The caller adds
    the dummy-prefix space; spaces become "▁" here."""

    def __init__(self, tokens, scores, unk_id):
        # token_to_id[word] = i in llama.cpp: a duplicate string maps to its last id.
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.scores = scores
        self.byte_ids = [self._byte_token(b, unk_id) for b in range(256)]

    def _byte_token(self, b, unk_id):
        # llama.cpp byte_to_token: "<0xXX>", else the single character, else
        # (our choice; llama.cpp throws) the unknown token.
        tid = self.vocab.get(f"<0x{b:02X}>")
        if tid is None and b < 0x80:
            tid = self.vocab.get(chr(b))
        return unk_id if tid is None else tid

    def encode(self, text):
        text = text.replace(" ", SPACE_MARK)
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

    def encode(self, data):
        """`data`: UTF-8 bytes of the text."""
        lookup, pieces, scores = self.lookup, self.pieces, self.scores
        ids = []
        if data and self.space_id is not None:
            ids.append(self.space_id)
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
