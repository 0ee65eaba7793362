"""Naming out-of-memory failures (``memory_for``). A module of its own, imported
with cism, so that everything a load does, its first imports included, can
run inside a named block (cism.load imports the loaders lazily)."""


class memory_for:
    """Context manager turning the OS refusing memory inside the block into a
    MemoryError that names the file and what was being done ("loading tensor
    'x' (n bytes)"); an inner, already-named MemoryError passes through.

    The message, the prefix that marks a named error and the exception to
    raise are all built on entry, while memory is still there: on the way
    out, with the memory gone, naming the failure allocates nothing (a
    concatenation or a new exception there could itself fail and let the
    unnamed error through). Python reports some failed allocations as
    RuntimeError ("can't allocate lock" when a file object or a lock cannot
    get its mutex), and the dynamic loader a module it cannot map as
    ImportError ("failed to map segment from shared object": cism imports a
    model family's compiled module on first use): those are out of memory
    too."""

    __slots__ = ("path", "doing", "prefix", "error")

    def __init__(self, path, doing):
        self.path, self.doing = str(path), doing
        try:
            self.prefix = self.path + ": "
            self.error = MemoryError(f"{path}: out of memory while {doing}")
        except MemoryError:   # built on the way out instead
            self.prefix = self.error = None

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if kind is None:
            return False
        if issubclass(kind, MemoryError):
            if str(error).startswith(self.prefix or self.path + ": "):
                return False
        elif not ((issubclass(kind, RuntimeError) and str(error).startswith("can't allocate"))
                  or (issubclass(kind, ImportError) and "failed to map segment" in str(error))):
            return False
        raise (self.error or MemoryError(f"{self.path}: out of memory while {self.doing}")) from None
