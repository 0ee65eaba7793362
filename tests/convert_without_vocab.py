"""Run llama.cpp's convert_hf_to_gguf.py on a model folder that has no
tokenizer (the random-weight checkpoints of the parity tests): the
converter's vocabulary step is skipped, everything else is llama.cpp's own.

    python convert_without_vocab.py LLAMA_CPP_DIR MODEL_DIR --outfile F --outtype f32
"""
import sys

root = sys.argv.pop(1)
sys.path.insert(0, root)
sys.path.insert(0, root + "/gguf-py")
import convert_hf_to_gguf as converter  # noqa: E402

_model_class = converter.get_model_class


def _without_vocab(*args, **kwargs):
    cls = _model_class(*args, **kwargs)
    cls.set_vocab = lambda self: None
    return cls


converter.get_model_class = _without_vocab
sys.argv[0] = "convert_hf_to_gguf.py"
converter.main()
