"""bench/batch.py measures batch sizes in rounds and takes each ratio
against batch 1 of the same round; these tests run it on the tiny
stories260K model."""
import json

import pytest

from bench_scripts import load_script


@pytest.fixture
def stories(data_dir):
    return str(data_dir / "models" / "stories260K" / "stories260K.bin")


def test_rounds_rotate_the_batch_sizes_and_pair_the_ratios(stories, monkeypatch, capsys):
    batch = load_script("batch")
    calls = []
    real_rate = batch.rate

    def recorded(model, b, tokens, rng):
        calls.append(b)
        return real_rate(model, b, tokens, rng)

    monkeypatch.setattr(batch, "rate", recorded)
    batch.main(["--model", stories, "--precision", "fp32", "--batch", "4", "2", "--tokens", "2",
                "--repeats", "3", "--json"])
    # batch 1 joins even when not asked for; one warm-up and three rounds,
    # each starting one batch size later than the one before
    assert calls == [1, 2, 4, 2, 4, 1, 4, 1, 2, 1, 2, 4]
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [r["batch"] for r in rows] == [1, 2, 4]
    assert rows[0]["speedup_vs_batch1"] == 1.0
    assert all(r["tok_s"] > 0 and r["speedup_vs_batch1"] > 0 for r in rows)


def test_batch_sizes_below_one_are_refused(stories, capsys):
    batch = load_script("batch")
    with pytest.raises(SystemExit):
        batch.main(["--model", stories, "--batch", "0", "4"])
    assert "batch sizes must be at least 1" in capsys.readouterr().err
