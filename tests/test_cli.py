"""`mpcache <verb>` (experiments/cli.py): every verb answers --help, bad command lines are one
line and exit 2, a shortcut verb sets its experiment, and a verb's flags are parsed afresh on
every call."""
from __future__ import annotations

import subprocess
import sys

import pytest

from experiments import cli
from tests.test_docs_commands import COMMANDS


def _verbs_in_docs() -> set[str]:
    return {words[1] for _, words in COMMANDS if words[0].endswith("mpcache")}


def test_the_docs_run_commands_through_verbs_that_exist():
    used = _verbs_in_docs()
    assert {"run", "party", "pareto", "natural-tasks"} <= used
    assert used <= set(cli.VERBS)


@pytest.mark.parametrize("verb", sorted(name for name, v in cli.VERBS.items()
                                        if not v.global_flags))
def test_a_verb_with_flags_of_its_own_answers_help(verb, capsys):
    """In this process: each module builds its FlagValues per call, so nothing collides."""
    with pytest.raises(SystemExit) as stop:
        cli.main(["mpcache", verb, "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: mpcache {verb} [flags]")
    assert "--flagfile" in out       # absl's own: the same flag language as `mpcache run`


@pytest.mark.parametrize("verb", ["run", "party", "kvpress-crosscheck"])
def test_a_verb_on_the_process_wide_flags_answers_help(verb):
    """In a process of its own: these modules define absl's process-wide flags."""
    done = subprocess.run([sys.executable, "-m", "experiments.cli", verb, "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: mpcache {verb} [flags]")
    flag = {"run": "--flagfile", "party": "--node_config", "kvpress-crosscheck": "--kvpress_python"}
    assert flag[verb] in done.stdout


def test_the_overview_lists_every_verb_and_an_unknown_verb_is_an_error(capsys):
    assert cli.main(["mpcache"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in cli.VERBS)
    assert cli.main(["mpcache", "evaluate"]) == 2
    assert "unknown verb 'evaluate'" in capsys.readouterr().err


def test_a_shortcut_verb_sets_its_experiment_and_refuses_another(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["mpcache", "accuracy", "--experiment=mpc_cost"])
    assert stop.value.code == 2
    assert "sets --experiment=accuracy" in capsys.readouterr().err


def test_bad_flags_and_positionals_are_one_line_and_exit_2(tmp_path, capsys):
    from experiments import compile_time, party_table
    with pytest.raises(SystemExit) as stop:
        compile_time.main(["mpcache compile-time", "--bogus=1"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bogus" in err
    with pytest.raises(SystemExit) as stop:
        party_table.main(["mpcache party-table"])           # FOLDER missing
    assert stop.value.code == 2 and "FOLDER" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        party_table.main(["mpcache party-table", str(tmp_path / "absent")])
    assert stop.value.code == 2 and "is not a folder" in capsys.readouterr().err


def test_flags_are_parsed_afresh_on_every_call():
    """A value given in one call is not the next call's default (tests call mains in turn)."""
    from experiments import compile_time
    first = compile_time._flags()
    cli.parse(first, ["prog", "--model=smollm2-135m", "--lengths", "64"], None)
    assert (first.model, first.lengths) == ("smollm2-135m", "64")
    second = compile_time._flags()
    cli.parse(second, ["prog"], None)
    assert (second.model, second.lengths) == ("gemma3-270m", "8192,16384,32768")


def test_a_required_flag_missing_is_an_error(capsys):
    from experiments import natural_tasks
    with pytest.raises(SystemExit) as stop:
        natural_tasks.main(["mpcache natural-tasks", "--num_samples=2"])
    assert stop.value.code == 2 and "--out" in capsys.readouterr().err


def test_compile_time_reports_memory_for_a_policy_and_restores_the_bounds(capsys):
    """--policy adds the compression program, each line carries its temporary buffers, a
    length past the context stretches it, and --unbounded lifts the memory bounds for that
    call only (the runs' programs read them at trace time)."""
    from experiments import compile_time
    from mpcache_jax import attention
    from mpcache_jax.policies import base
    bounds = (attention.LOOPED_SCORE_ELEMENTS, attention.TILED_MIN_TOKENS,
              base.VOTE_BLOCK_ELEMENTS)
    assert compile_time.main(["mpcache compile-time", "--model=llama-tiny", "--lengths=96",
                              "--policy=mpcache_exact", "--unbounded"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(": ")[0] for line in lines] == [
        "llama-tiny, 96 tokens, prefill", "llama-tiny, 96 tokens, mpcache_exact compress"]
    assert all("temporary buffers" in line for line in lines)
    assert (attention.LOOPED_SCORE_ELEMENTS, attention.TILED_MIN_TOKENS,
            base.VOTE_BLOCK_ELEMENTS) == bounds
    from models.catalog import get_config
    past = get_config("llama-tiny").max_position + 8
    rows = compile_time.compile_programs("llama-tiny", past, num_layers=1)
    assert [r["program"] for r in rows] == ["prefill"] and rows[0]["temp_bytes"] > 0
    with pytest.raises(SystemExit) as stop:
        compile_time.main(["mpcache compile-time", "--model=llama-tiny", "--policy=nope"])
    assert stop.value.code == 2 and "--policy" in capsys.readouterr().err
