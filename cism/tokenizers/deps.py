"""Lazy imports of the optional `text` dependencies, with one clear message."""

_HINT = 'pip install "cism[text]"'


def _missing(name, purpose):
    return ImportError(f"cism.Tokenizer needs the '{name}' package {purpose}; "
                       f"install the text extras: {_HINT}")


def need_regex():
    try:
        import regex
    except ImportError:
        raise _missing("regex", "for byte-level BPE pre-tokenization") from None
    return regex


def need_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise _missing("tokenizers", "to read tokenizer.json files") from None
    return tokenizers


def need_jinja2():
    try:
        import jinja2
        import jinja2.sandbox  # noqa: F401
    except ImportError:
        raise _missing("jinja2", "to render chat templates") from None
    return jinja2
