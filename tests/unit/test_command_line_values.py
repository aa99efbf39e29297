"""forge.options.last_value / last_int: the value a server's or client's parser keeps for an option, read the
one way every checker of a recorded command line (the GPU fit, the batch profile, the tier time guess)
reads it: the last occurrence, any spelling, `--opt V` or `--opt=V`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from forge import options  # noqa: E402
from forge.lab import tierguess  # noqa: E402


def test_the_last_occurrence_of_any_spelling_wins():
    argv = ["serve", "m", "--max-num-seqs", "128", "-tp", "2", "--max-num-seqs=4", "--tensor-parallel-size", "1"]
    assert options.last_int(argv, "--max-num-seqs") == 4
    assert options.last_int(argv, "--tensor-parallel-size", "-tp") == 1
    assert options.last_value(argv, "--kv-cache-dtype") is None
    assert options.last_int(["--max-num-seqs"], "--max-num-seqs") is None              # no value after it
    assert options.last_int(["--max-num-seqs", "x"], "--max-num-seqs") is None


def test_the_underscore_spelling_is_the_same_option():
    # vLLM's parser reads --max_num_seqs as --max-num-seqs: before, a command written so counted as unset
    # (a TP2 record priced as TP1 by plan --against, a capped server guessed as uncapped)
    argv = ["serve", "m", "--tensor_parallel_size", "2", "--max_num_seqs=4", "--served-model-name", "a_b"]
    assert options.last_int(argv, "--tensor-parallel-size", "-tp") == 2
    assert options.last_int(argv, "--max-num-seqs") == 4
    assert options.last_value(argv, "--served-model-name") == "a_b"          # values keep their underscores


def test_the_tier_guess_reads_an_equals_spelling_too():
    # before, the tier time guess read only `--opt N`: a server given --max-num-seqs=4 counted as uncapped
    assert tierguess.inflight(["--max-concurrency", "10"], ["--max-num-seqs=4"]) == 4
