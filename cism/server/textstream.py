"""From one choice's tokens to its text: incremental UTF-8 decoding, stop
strings (the text is cut before them, and generation stops), and the
per-token logprob entries of the chat and completions formats."""
from cism.generation import _StopFinder


class ChoiceText:
    """Feed a request's tokens as they come; get text that is safe to send
    (never half a character, never text a stop string may still cut)."""

    def __init__(self, tokenizer, stops):
        self.tok = tokenizer
        self.decoder = tokenizer.stream_decoder(skip_special=True)
        self.finder = _StopFinder(stops)
        self.stop_hit = None
        self.tokens = 0            # tokens that count (up to a stop string)
        self.text = ""

    def feed(self, tokens):
        """Text for new tokens (stops at a stop string: later tokens count
        for nothing). Returns (text, tokens consumed)."""
        out = []
        used = 0
        for t in tokens:
            if self.stop_hit is not None:
                break
            used += 1
            piece, hit = self.finder.feed(self.decoder.push(t))
            out.append(piece)
            if hit is not None:
                self.stop_hit = hit
        self.tokens += used
        text = "".join(out)
        self.text += text
        return text, used

    def close(self):
        """The text still held back, once generation has ended."""
        if self.stop_hit is not None:
            return ""
        piece, hit = self.finder.feed(self.decoder.flush())
        if hit is not None:
            self.stop_hit = hit
            self.text += piece
            return piece
        rest = piece + self.finder.flush()
        self.text += rest
        return rest

    # ---- logprobs ----

    def _token_text(self, token):
        return self.tok.token_bytes(token).decode("utf-8", errors="replace")

    def chat_logprobs(self, tokens, lps, tops):
        """Entries of a chat choice's "logprobs": {"content": [...]}."""
        out = []
        for t, lp, top in zip(tokens, lps, tops):
            b = self.tok.token_bytes(t)
            out.append({"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b),
                        "top_logprobs": [{"token": self._token_text(i), "logprob": v,
                                          "bytes": list(self.tok.token_bytes(i))} for i, v in top]})
        return out

    def completion_logprobs(self, tokens, lps, tops, offset):
        """The completions format: tokens, token_logprobs, top_logprobs, text_offset."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp, top in zip(tokens, lps, tops):
            text = self._token_text(t)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({self._token_text(i): v for i, v in top})
            out["text_offset"].append(offset)
            offset += len(text)
        return out, offset
