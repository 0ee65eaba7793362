"""What the vocabulary sources share: file reads whose every failure is a
ValueError naming the file, the HF side files next to a vocabulary
(tokenizer_config.json, chat_template.jinja, generation_config.json), and the
list of ids that end generation."""
import json
from pathlib import Path

# Token texts llama.cpp treats as end of generation whatever the metadata says
# (llama_vocab::impl::load); chat models stop on them.
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
             "<|eom_id|>", "<EOT>")


def read_bytes(path, what):
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{path}: {what} not found") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: expected a {what} file, found a directory") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read {what}: {e.strerror or e}") from None


def read_text(path, what):
    try:
        return read_bytes(path, what).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: {what} is not UTF-8 text (byte {e.start})") from None


def read_json(path, what):
    return parse_json(read_text(path, what), path, what)


def parse_json(text, path, what):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON in {what}: {e.msg} "
                         f"(line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise ValueError(f"{path}: invalid JSON in {what}: nested too deeply") from None


def expect(cond, path, msg):
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


def read_hf_config(directory):
    """Settings from the HF files next to a tokenizer: tokenizer_config.json,
    chat_template.jinja and generation_config.json (all optional)."""
    d = Path(directory)
    cfg = {}
    p = d / "tokenizer_config.json"
    if p.exists():
        data = read_json(p, "tokenizer_config.json")
        expect(isinstance(data, dict), p, "tokenizer_config.json must hold a JSON object")
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
        out["chat_template"] = read_text(jinja, "chat_template.jinja")
    gen = d / "generation_config.json"
    if gen.exists():
        data = read_json(gen, "generation_config.json")
        eos = data.get("eos_token_id") if isinstance(data, dict) else None
        eos = eos if isinstance(eos, list) else [eos]
        out["eos_ids"] = [e for e in eos if isinstance(e, int) and not isinstance(e, bool)]
    return out


def id_of(vocab, token):
    return None if token is None else vocab.get(token)


def eos_list(eos_id, extra, tokens, special_ids, n):
    """The EOS id first, then the end-of-turn ids the metadata names, then
    every special token whose text llama.cpp treats as end of generation."""
    ids = [eos_id] if eos_id is not None else []
    ids += [e for e in extra if 0 <= e < n]
    ids += [i for i in sorted(special_ids) if tokens[i] in EOG_TEXTS]
    return ids
