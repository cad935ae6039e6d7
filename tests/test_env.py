"""Who-am-I detection: torchrun's and SLURM's variables, as the launchers really set them."""

from __future__ import annotations

import pytest

from dtrain import config
from dtrain.config import Config
from dtrain.process.env import Env, detect, device_index, expand_nodelist, expand_tasks_per_node, port_for_job
from dtrain.core.errors import UserError
from dtrain.run import resolve_run_name

# What Debian's slurm-wlm 22.05 sets, read from a real job: `sbatch --ntasks=2` runs the batch
# script with the job's variables, then `srun` adds the step's to each of its tasks.
BATCH = {
    "SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_NODELIST": "gpu[07-08]", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
    "SLURM_NTASKS": "8", "SLURM_NPROCS": "8", "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
}


def srun_task(procid: int, localid: int, nodeid: int, **extra: str) -> dict[str, str]:
    env = dict(BATCH, SLURM_STEP_ID="0", SLURM_STEPID="0", SLURM_STEP_NODELIST="gpu[07-08]",
               SLURM_STEP_NUM_NODES="2", SLURM_STEP_NUM_TASKS="8",
               SLURM_STEP_TASKS_PER_NODE="4(x2)", SLURM_PROCID=str(procid),
               SLURM_LOCALID=str(localid), SLURM_NODEID=str(nodeid))
    env.update(extra)
    return env


@pytest.mark.parametrize("compressed, hosts", [
    ("node1", ["node1"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),
    ("a[1-2],b3,c[009-010]", ["a1", "a2", "b3", "c009", "c010"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("10.0.0.[5-6]", ["10.0.0.5", "10.0.0.6"]),
])
def test_expand_nodelist(compressed: str, hosts: list[str]) -> None:
    assert expand_nodelist(compressed) == hosts


def test_expand_tasks_per_node() -> None:
    assert expand_tasks_per_node("4") == [4]
    assert expand_tasks_per_node("4(x3)") == [4, 4, 4]
    assert expand_tasks_per_node("2(x2),1") == [2, 2, 1]
    with pytest.raises(UserError, match="tasks per node"):
        expand_tasks_per_node("four")


def test_srun_task_maps_to_ranks_and_first_node() -> None:
    env = detect(srun_task(procid=6, localid=2, nodeid=1))
    assert env == Env(launcher="slurm", rank=6, local_rank=2, world_size=8, local_world_size=4,
                      node_rank=1, num_nodes=2, master_addr="gpu07",
                      master_port=port_for_job("4242"), slurm_job_id="4242")
    assert env.describe() == "slurm: 2 node(s) x 4 rank(s) = world size 8"


def test_master_port_and_restart_count_from_the_environment() -> None:
    env = detect(srun_task(0, 0, 0, MASTER_PORT="31000", MASTER_ADDR="10.1.1.1",
                           SLURM_RESTART_COUNT="2"))
    assert (env.master_addr, env.master_port, env.restart_count) == ("10.1.1.1", 31000, 2)


def test_port_for_job_is_stable_and_in_range() -> None:
    assert port_for_job("4242") == port_for_job("4242")
    assert port_for_job("4242") != port_for_job("4243")
    assert all(1024 < port_for_job(str(j)) < 65536 for j in (0, 1, 99999, 123456789))


def test_step_smaller_than_the_job_uses_the_step_layout() -> None:
    # `srun -N1 -n2` inside the 2-node, 8-task job: a one-node step of 2 tasks on gpu08.
    env = detect(srun_task(1, 1, 0, SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NUM_NODES="1",
                           SLURM_STEP_TASKS_PER_NODE="2", SLURM_STEP_NODELIST="gpu08"))
    assert (env.world_size, env.num_nodes, env.local_world_size, env.master_addr) == (2, 1, 2, "gpu08")


def test_torchrun_variables_win_over_slurm() -> None:
    # torchrun started by srun (slurm/train_torchrun.sbatch): SLURM's task is the agent, not the rank.
    environ = srun_task(1, 0, 1, RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4",
                        GROUP_RANK="1", MASTER_ADDR="gpu07", MASTER_PORT="29400")
    env = detect(environ)
    assert (env.launcher, env.rank, env.local_rank, env.world_size, env.node_rank, env.num_nodes) == \
        ("torchrun", 5, 1, 8, 1, 2)
    assert env.slurm_job_id == "4242"  # still known: the run name and the requeue need it


def test_batch_script_with_several_tasks_is_refused() -> None:
    with pytest.raises(UserError, match="not started by srun.*srun python launch/train.py"):
        detect(BATCH)
    with pytest.raises(UserError, match="2 tasks"):
        detect({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2"})  # --nodes=2, no --ntasks


def test_batch_script_with_one_task_is_a_single_run_of_that_job() -> None:
    env = detect({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"})
    assert (env.launcher, env.world_size, env.slurm_job_id) == ("single", 1, "7")
    assert detect({}) == Env(launcher="single")


def test_uneven_tasks_per_node_are_refused() -> None:
    uneven = srun_task(0, 0, 0, SLURM_STEP_NUM_TASKS="7", SLURM_STEP_TASKS_PER_NODE="4,3")
    with pytest.raises(UserError, match=r"unevenly.*\(4,3\).*--ntasks-per-node"):
        detect(uneven)
    # 3 + 1 divides evenly by the node count but is still uneven
    with pytest.raises(UserError, match="unevenly"):
        detect(srun_task(0, 0, 0, SLURM_STEP_NUM_TASKS="4", SLURM_STEP_TASKS_PER_NODE="3,1"))


def test_bad_number_names_the_variable() -> None:
    with pytest.raises(UserError, match="SLURM_PROCID='x' is not an integer"):
        detect(srun_task(0, 0, 0, SLURM_PROCID="x"))


def test_device_index_against_visible_gpus() -> None:
    four_per_node = detect(srun_task(procid=6, localid=2, nodeid=1))
    assert device_index(four_per_node, visible_gpus=4) == 2
    # --gpus-per-task=1: SLURM shows each task only its own GPU
    assert device_index(four_per_node, visible_gpus=1) == 0
    with pytest.raises(UserError, match=r"4 tasks on this node but 2 visible GPU\(s\).*"
                                        r"--ntasks-per-node=2.*--gpus-per-node=4"):
        device_index(four_per_node, visible_gpus=2)
    torchrun = Env(launcher="torchrun", rank=1, local_rank=1, world_size=2, local_world_size=2)
    with pytest.raises(UserError, match="--nproc_per_node=1"):
        device_index(torchrun, visible_gpus=1)


def test_unnamed_run_takes_the_job_id() -> None:
    cfg = resolve_run_name(Config(), detect(srun_task(0, 0, 0)))
    assert cfg.run.name == "job_4242"
    named = resolve_run_name(config.load(None, ["run.name=mine"]), detect(srun_task(0, 0, 0)))
    assert named.run.name == "mine"
    alone = resolve_run_name(Config(), detect({}))
    assert alone.run.name == "default"


def test_rank_and_world_size_left_over_without_a_rendezvous_are_one_line() -> None:
    with pytest.raises(UserError) as raised:
        detect({"RANK": "0", "WORLD_SIZE": "2"})
    assert str(raised.value) == (
        "environment error: RANK=0 and WORLD_SIZE=2 are set but MASTER_ADDR and MASTER_PORT "
        "not: left over from another launch? unset RANK and WORLD_SIZE to train in one "
        "process, or start the ranks with torchrun")
    one = detect({"RANK": "0", "WORLD_SIZE": "1"})  # a world of one needs no rendezvous
    assert one.world_size == 1
