"""Hugging Face model directories: config.json plus safetensors weights, one file
or several shards listed in model.safetensors.index.json. Dense, Surjo and FWKV
directories all load here; tensor names are whatever the files hold."""
import os

from ._common import Checkpoint, CheckpointError, file_in_dir, read_small_file
from .lazy import load_all
from .safetensors_file import lazy_tensors, parse_json, read_header

CONFIG_NAME = "config.json"
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Real configs are a few kB and indexes well under 1 MB even for 1000 shards.
MAX_CONFIG_BYTES = 16 * 1024 * 1024
MAX_INDEX_BYTES = 64 * 1024 * 1024

# JSON types of the config keys the model families read. Checked here so that a
# string where a number belongs is reported against the file, not as a
# TypeError deep inside Config.from_hf. Bounds are the model's business.
_INT_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "vocab_size", "max_position_embeddings")
_OPTIONAL_INT_KEYS = ("head_dim",)          # null means "hidden_size / heads"
_NUMBER_KEYS = ("rms_norm_eps", "rope_theta")
_BOOL_KEYS = ("tie_word_embeddings",)
# rope_scaling (transformers 4) and rope_parameters (transformers 5, which also
# moves rope_theta inside it) are objects or null.
_OBJECT_KEYS = ("rope_scaling", "rope_parameters")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _check_config_types(path, config):
    def bad(key, expected):
        value = config[key]
        raise CheckpointError(path, f"{key} is {value!r} (JSON {type(value).__name__}), expected {expected}")

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise CheckpointError(path, "config has no model_type string")
    for key in _INT_KEYS + _OPTIONAL_INT_KEYS:
        if key in config:
            value = config[key]
            if value is None and key in _OPTIONAL_INT_KEYS:
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                bad(key, "an integer")
    for key in _NUMBER_KEYS:
        if key in config:
            value = config[key]
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                bad(key, "a number")
    for key in _BOOL_KEYS:
        if key in config and not isinstance(config[key], bool):
            bad(key, "true or false")
    for key in _OBJECT_KEYS:
        if config.get(key) is not None and not isinstance(config[key], dict):
            bad(key, "an object or null")


def _read_config(directory):
    path = file_in_dir(directory, CONFIG_NAME, "file")
    config = parse_json(path, read_small_file(path, MAX_CONFIG_BYTES, "config.json"), "config.json")
    if not isinstance(config, dict):
        raise CheckpointError(path, f"config.json holds a JSON {type(config).__name__}, expected an object")
    _check_config_types(path, config)
    return config


def _check_dir(path):
    if not os.path.exists(path):
        raise CheckpointError(path, "no such directory")
    if not os.path.isdir(path):
        raise CheckpointError(path, "not a directory")


def read_config(path):
    """config.json of a model directory, type-checked."""
    path = os.fspath(path)
    _check_dir(path)
    return _read_config(path)


def _read_index(directory):
    """{shard real path: set of tensor names the index puts there}."""
    index_path = file_in_dir(directory, INDEX_NAME, "file")
    index = parse_json(index_path, read_small_file(index_path, MAX_INDEX_BYTES, "the index"), "the index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(index_path, "has no weight_map object")
    if not weight_map:
        raise CheckpointError(index_path, "weight_map is empty")
    shards = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(index_path, f"weight_map gives {shard!r}, expected a file name", name)
        if shard not in shards:
            file_in_dir(directory, shard, f"{INDEX_NAME} shard")
            shards[shard] = set()
        shards[shard].add(name)
    return index_path, {os.path.join(directory, shard): names for shard, names in shards.items()}


def _weight_files(directory):
    """Which safetensors files hold the weights, following transformers' order of
    preference: model.safetensors, then the shard index, then a lone *.safetensors."""
    if os.path.lexists(os.path.join(directory, SINGLE_NAME)):
        return None, {file_in_dir(directory, SINGLE_NAME, "file"): None}
    if os.path.lexists(os.path.join(directory, INDEX_NAME)):
        return _read_index(directory)
    try:
        names = sorted(n for n in os.listdir(directory)
                       if n.endswith(".safetensors") and not n.startswith("."))
    except OSError as e:
        raise CheckpointError(directory, f"cannot list: {e.strerror or e}") from None
    if len(names) == 1:
        return None, {file_in_dir(directory, names[0], "file"): None}
    if names:
        raise CheckpointError(directory, f"{len(names)} safetensors files ({', '.join(names[:4])}"
                              f"{', ...' if len(names) > 4 else ''}) but no {INDEX_NAME} to say how they fit")
    hint = ""
    if any(os.path.exists(os.path.join(directory, n))
           for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        hint = " (only PyTorch .bin weights are present: convert them to safetensors)"
    raise CheckpointError(directory, f"no {SINGLE_NAME}, {INDEX_NAME} or other *.safetensors file{hint}")


def load_hf_dir(path, lazy=False, mmap=False):
    """A Hugging Face model directory -> Checkpoint (format "hf"): float32
    arrays, or with ``lazy`` lazy.FileTensors read when the model packs them."""
    directory = os.fspath(path)
    _check_dir(directory)
    config = _read_config(directory)
    index_path, files = _weight_files(directory)

    # Headers first, all of them: every consistency problem between index and
    # shards is reported before gigabytes are read.
    headers = {shard: read_header(shard)[0] for shard in sorted(files)}
    found_in = {}
    for shard, entries in headers.items():
        listed = files[shard]
        for e in entries:
            if e.name in found_in:
                raise CheckpointError(shard, f"also present in {found_in[e.name]}", e.name)
            found_in[e.name] = shard
            if listed is not None and e.name not in listed:
                raise CheckpointError(shard, f"not assigned to this shard by {index_path}", e.name)
        if listed is not None:
            names = {e.name for e in entries}
            for name in sorted(listed - names):
                raise CheckpointError(shard, f"listed for this shard by {index_path} but absent", name)

    weights = {}
    for shard, entries in headers.items():
        weights.update(lazy_tensors(shard, entries, mmap=mmap and lazy))
    if not lazy:
        weights = load_all(weights)

    tokenizer = None
    if any(os.path.isfile(os.path.join(directory, n)) for n in _TOKENIZER_FILES):
        tokenizer = {"kind": "hf_dir", "path": directory}
    return Checkpoint(config=config, weights=weights, path=directory, format="hf", tokenizer=tokenizer)
