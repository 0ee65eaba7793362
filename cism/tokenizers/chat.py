"""Chat templates rendered as HF transformers renders them
(PreTrainedTokenizerBase.apply_chat_template): a sandboxed Jinja environment
with trim_blocks and lstrip_blocks, loop controls, `raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII text, and the `{% generation %}`
block (a no-op here; HF uses it to mark assistant tokens)."""
import json
from datetime import datetime

from cism.tokenizers.deps import need_jinja2

_ENV = None


def _environment():
    global _ENV
    if _ENV is not None:
        return _ENV
    jinja2 = need_jinja2()
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_render_body")
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _render_body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # HF overrides Jinja's tojson: no HTML escaping, non-ASCII kept as is.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    _ENV = env
    return env


def compile_template(source):
    env = _environment()
    import jinja2
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not parse: {e.message} (line {e.lineno})") from None


def render(template, messages, add_generation_prompt, variables):
    import jinja2
    if not isinstance(messages, (list, tuple)):
        raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
    variables = dict(variables)
    variables.setdefault("tools", None)
    variables.setdefault("documents", None)
    try:
        return template.render(messages=list(messages),
                               add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as e:
        # raise_exception() in the template, or a sandbox violation
        raise ValueError(f"chat template error: {e}") from None
