"""cism's OpenAI-compatible HTTP server.

    cism serve --model model.gguf --precision int8          # then: http://127.0.0.1:8080/

or, in Python:

    import cism
    from cism.server import create_app
    engine = cism.Engine(cism.load("model.gguf", precision="int8"))
    app = create_app(engine, model_name="my-model")      # an ASGI app (Starlette)
    # uvicorn.run(app, port=8080)

Needs the "serve" extra (pip install "cism[serve]"); scale-out on Ray Serve
is cism.server.ray ("cism[ray]").
"""


def create_app(engine, **kwargs):
    """The ASGI app serving a running cism.Engine (see cism.server.app.create_app)."""
    from cism.server.app import create_app as _create_app
    return _create_app(engine, **kwargs)


def __getattr__(name):
    if name == "serve":
        from cism.server.run import serve
        return serve
    raise AttributeError(name)
