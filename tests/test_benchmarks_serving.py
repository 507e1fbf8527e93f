"""`python -m benchmarks serving --quick` on example_app's simulated engine: each tool ran and
produced its figures, without and with the middleware. Never asserts a speed.

vLLM's serving benchmark needs the vLLM venv (.ci/vllm.sh creates it) and AIPerf its own
(.venv-aiperf, created on demand by the benchmark; not here: `--no-install`): where one is
missing, the test checks that the benchmark says so and, for AIPerf, that benchmarks' own
departure client measured the cancellation sweep instead. CI's vLLM step runs the same quick
mode against real vLLM with `--require-tools`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import serving
from benchmarks.serving import AIPERF
from benchmarks.serving_servers import MODEL_DIR, Target, have_vllm

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.benchmarks, pytest.mark.timeout(400)]


def number(value: Any) -> float:
    assert isinstance(value, (int, float)), value
    assert not math.isnan(value)
    return float(value)


def test_serving_quick_on_the_simulated_engine(tmp_path: Path) -> None:
    command = ["serving", "--quick", "--target", "sim", "--no-install"]
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks", *command],
        cwd=ROOT,
        env={**os.environ, "BENCH_RESULTS": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    results = json.loads((tmp_path / "serving.json").read_text())
    assert results["benchmark"] == "serving"
    assert results["quick"] is True
    sim = results["targets"]["sim"]
    assert set(sim["startup_s"]) == {"without", "with"}

    bench = sim["vllm_bench"]
    if have_vllm():
        assert bench["status"] == "ran"
        for variant in ("without", "with"):
            (run,) = bench["runs"]["8"][variant]
            assert run["completed"] == results["settings"]["bench_prompts"]["8"]
            for key in ("request_throughput", "output_throughput", "median_ttft_ms"):
                assert number(run[key]) > 0
            for key in ("p99_ttft_ms", "median_tpot_ms", "median_itl_ms", "p99_itl_ms"):
                number(run[key])
            assert "Serving Benchmark Result" in run["table"]
        assert "vLLM's serving benchmark" in completed.stdout
    else:
        assert bench["status"].startswith("not run: no vLLM")

    sweep = sim["cancellation"]
    if AIPERF.exists():
        assert sweep["tool"] == "aiperf", sweep["status"]
    else:
        assert sweep["tool"] == "departure client"
        assert "AIPerf could not run" in sweep["status"]
    for variant in ("without", "with"):
        (run,) = sweep["cells"]["50%/0"][variant]
        assert run["cancelled"] + run["completed"] == run["requests"]
        assert run["completed"] > 0
        assert number(run["goodput_tokens_per_s"]) > 0
        assert number(run["ttft_p50_ms"]) > 0
        number(run["cancelled_tokens"])
        number(run["wasted_after_leaving"])  # the simulated engine counts it itself

    for variant in ("without", "with"):
        (run,) = sim["short"]["runs"][variant]
        assert run["short_status"] == 200
        assert run["short_tokens"] == results["settings"]["short_tokens"]
        assert number(run["short_ttft_s"]) > 0
    assert "a short request behind cancelled ones" in completed.stdout
    assert (tmp_path / "benchmarks-serving.png").read_bytes().startswith(b"\x89PNG")


# A tokenizer folder like the tiny model's (tokenizer.json, tokenizer_config.json), built with
# AIPerf's own venv, then loaded the way AIPerf loads --tokenizer.
LOAD_TOKENIZER = """
import sys
import tokenizers
import transformers

folder = sys.argv[1]
bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
trainer = tokenizers.trainers.BpeTrainer(
    vocab_size=300,
    special_tokens=["<s>", "</s>", "<pad>"],
    initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
)
bpe.train_from_iterator(["the client went away, so the server stopped"] * 5, trainer=trainer)
transformers.PreTrainedTokenizerFast(
    tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
).save_pretrained(folder)

from aiperf.common.tokenizer import Tokenizer

print(len(Tokenizer.from_pretrained(folder)("the server")["input_ids"]))
"""


def test_aiperf_gets_an_absolute_tokenizer_folder_and_no_offline_switches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # .ci/vllm.sh exports both; with either one AIPerf 0.13.0 cannot load a folder path.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    env = serving.aiperf_env()
    assert "HF_HUB_OFFLINE" not in env
    assert "TRANSFORMERS_OFFLINE" not in env
    assert env["TOKENIZERS_PARALLELISM"] == "false"  # the rest passes through
    server = Target("vllm", "with", Path("-"), port=8000)
    args = serving.aiperf_args(server, serving.QUICK, 50, 0.0, Path("out"))
    tokenizer = Path(args[args.index("--tokenizer") + 1])
    assert tokenizer.is_absolute()
    assert tokenizer == MODEL_DIR.resolve()
    assert args[args.index("--model") + 1] == "tiny-llama"  # the served name, not the folder


@pytest.mark.skipif(not AIPERF.exists(), reason=f"no AIPerf venv at {AIPERF.parent.parent}")
@pytest.mark.timeout(180)
def test_aiperf_loads_a_tokenizer_folder_in_a_ci_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    folder = tmp_path / "tokenizer"
    completed = subprocess.run(
        [str(AIPERF.parent / "python"), "-c", LOAD_TOKENIZER, str(folder)],
        cwd=tmp_path,
        env=serving.aiperf_env(),
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert int(completed.stdout.split()[-1]) > 0
