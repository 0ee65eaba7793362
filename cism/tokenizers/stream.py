"""Incremental decoding: text out as soon as it is complete UTF-8."""
import codecs


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


class HFStreamDecoder:
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


