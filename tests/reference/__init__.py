"""Independent NumPy oracles for every model family cism runs (STYLE.md rule 13).

Each module is a small, readable forward pass written from the model's equations
(and, for the in-house families, from the behavioural spec in
``shared/spec/runtime.cpp.txt``). They depend on NumPy only and never import
``cism``: an oracle must not call the code under test.

    dense    Llama and Qwen3 (HF names and config keys); checked against transformers
    llama2c  karpathy/llama2.c legacy ``.bin`` checkpoints and ``tokenizer.bin``
    surjo    the Surjo hybrid (XSA attention + Gated DeltaNet, recurrent passes)
    fwkv     the FWKV recurrent family (factorized tied embedding, WKV state)
    canonical  the kernels' fp32-activation dot (csrc/kernels.h) and the packed
             weight layouts (csrc/formats.h), for bit-for-bit checks
    exact    Fractions and 80-digit transcendental values for equations written
             out by hand from the spec (tiny Surjo and FWKV models)

Numeric policy: every module computes in float64 by default (``dtype=np.float64``)
so that it sits well inside any float32 engine's error; ``dtype=np.float32`` is
offered for speed on real-sized models.
"""
