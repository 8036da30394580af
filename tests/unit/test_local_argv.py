"""`orchestrator local` hands every rank the flags it was given: what `run` parses from the
argv that `local` builds is what `local` parsed (every flag of RUN_OPTIONS, --engine too)."""

from orchestrator.cli.local import _run_argv, local
from orchestrator.cli.run import run


def _parsed(command, argv: list[str]) -> dict:
    return command.make_context(command.name, list(argv)).params


def test_every_run_flag_given_to_local_reaches_each_rank():
    given = ["--data-path=/d", "--log-path=/l", "--rl-phase=both", "--eval-interval=2", "--num-nodes=3",
             "--rank-weights=2,1,1", "--max-iterations=4", "--rehearsal", "--engine=vllm", "--debug-mode", "--resume",
             "rl.lr=1e-4"]
    params = _parsed(local, given)
    argv = _run_argv(params, local.params)
    ranked = _parsed(run, [*argv, "--master"])
    assert {k: v for k, v in ranked.items() if k not in ("master", "worker")} == params
    assert "--engine=vllm" in argv


def test_flags_left_out_are_left_out():
    params = _parsed(local, ["--data-path=/d", "--log-path=/l", "--rl-phase=rollout", "--rollout-split=train-only"])
    assert _run_argv(params, local.params) == ["--data-path=/d", "--log-path=/l", "--rl-phase=rollout",
                                               "--rollout-split=train-only"]


def test_ranks_sharing_the_machine_split_its_cores_unless_the_environment_says():
    from orchestrator.cli.local import cores, thread_budget

    assert thread_budget(1, {}) == {}  # one rank has the machine to itself: torch's own default
    assert thread_budget(2, {}) == {"OMP_NUM_THREADS": str(max(1, cores() // 2))}
    assert thread_budget(cores() + 1, {}) == {"OMP_NUM_THREADS": "1"}  # never zero
    assert thread_budget(3, {"OMP_NUM_THREADS": "4"}) == {}  # the user's choice stands
