"""Regenerate tests/data/ggml/: a tiny random Llama GGUF quantised by llama.cpp's
own llama-quantize to each ggml type cism decodes beyond Q8_0/Q4_0/Q4_1.

    python3 tools/make_ggml_test_files.py --quantize /path/to/llama-quantize

The float32 source is written with gguf-py from a fixed seed (it is not kept:
only the quantised files are committed), then `llama-quantize SRC DST TYPE` is
run once per preset below; llama-quantize picks the per-tensor types of its
mixes (Q4_K_M keeps output.weight and some ffn_down/attn_v at Q6_K, and so
on). Every row is 256 wide, a whole K-quant super-block, so no tensor falls
back to another type. tests/test_ggml_quants.py checks that every type in
ggml_types.DECODED occurs in some file.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "data", "ggml")

# One layer of hidden 256 (4 query heads of 64 sharing one KV head),
# feed-forward 256, vocabulary 64: about 390K weights, 160-310 KB per file.
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, CONTEXT = 256, 256, 4, 1, 1, 256
# Every preset keeps output.weight at Q6_K, so Q6_K needs no file of its own.
PRESETS = ("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "IQ4_XS", "IQ4_NL", "Q5_0", "Q5_1")
SEED = 20260101

# A SentencePiece-style vocabulary (tokenizer.ggml.model = llama, as
# stories260K's): specials, the word-start marker, letters, a few pieces.
SPECIALS = ["<unk>", "<s>", "</s>"]
PIECES = (["\u2581"] + list("abcdefghijklmnopqrstuvwxyz") + list(".,!?'")
          + ["\u2581t", "\u2581a", "he", "\u2581the", "in", "er", "an", "on", "\u2581s", "\u2581w",
             "at", "en", "nd", "ou", "\u2581o", "\u2581b", "ed", "it", "\u2581h", "\u2581c",
             "is", "or", "ar", "\u2581and", "\u2581to", "ll", "\u2581f", "\u2581m", "es"])
VOCAB = SPECIALS + PIECES


def write_source(path):
    import gguf
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("cism ggml test model (random weights)")
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(VOCAB)
    # pieces score by length, so longer merges win (SentencePiece BPE)
    writer.add_token_scores([0.0] * len(SPECIALS) + [float(len(p)) for p in PIECES])
    writer.add_token_types([int(gguf.TokenType.UNKNOWN)] + [int(gguf.TokenType.CONTROL)] * 2
                           + [int(gguf.TokenType.NORMAL)] * len(PIECES))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)

    head_dim = HIDDEN // HEADS
    shapes = {"token_embd.weight": (len(VOCAB), HIDDEN), "output_norm.weight": (HIDDEN,),
              "output.weight": (len(VOCAB), HIDDEN)}
    for i in range(LAYERS):
        shapes.update({f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                       f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN),
                       f"blk.{i}.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
                       f"blk.{i}.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
                       f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
                       f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN), f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
                       f"blk.{i}.ffn_down.weight": (HIDDEN, FFN)})
    rng = np.random.default_rng(SEED)
    for name, shape in shapes.items():
        if len(shape) == 1:
            w = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        else:
            # a heavy tail (Student t, 4 degrees of freedom) exercises the
            # block scales more than a normal would
            w = rng.standard_t(4, shape).astype(np.float32) * np.float32(1.0 / np.sqrt(shape[1]))
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quantize", default=shutil.which("llama-quantize"),
                    help="the llama-quantize binary (default: from PATH)")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    if not args.quantize:
        sys.exit("llama-quantize not found: pass --quantize PATH")
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "tiny-llama-f32.gguf")
        write_source(src)
        for preset in PRESETS:
            dst = os.path.join(args.out, f"tiny-llama.{preset}.gguf")
            cmd = [args.quantize, src, dst, preset, "1"]
            print("llama-quantize", os.path.basename(src), os.path.relpath(dst), preset, "1", flush=True)
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                sys.exit(done.stdout + done.stderr)


if __name__ == "__main__":
    main()
