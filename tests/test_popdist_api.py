"""The PopDist API under crafted environments, and across real instances launched by poprun."""

import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import popdist
from popdist import core
from popdist.topology import Topology


@pytest.fixture
def env(monkeypatch):
    """A clean PopDist environment; call env(VAR=value, ...) to set variables."""
    for name in core.POPDIST_VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def set_vars(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))

    return set_vars


def test_defaults_outside_poprun(env):
    assert not popdist.isPopdistEnvSet()
    assert popdist.getNumTotalReplicas() == 1
    assert popdist.getNumLocalReplicas() == 1
    assert popdist.getNumIpusPerReplica() == 1
    assert popdist.getReplicaIndexOffset() == 0
    assert popdist.getLocalInstanceIndex() == 0
    assert popdist.isUniformReplicasPerInstance()
    assert popdist.getNumInstances() == 1
    assert popdist.getInstanceIndex() == 0
    assert popdist.getDeviceId() == 0
    assert popdist.checkNumIpusPerReplica(1) and popdist.checkNumIpusPerReplica(4)


def test_second_instance_of_two_with_four_replicas(env):
    env(POPDIST_NUM_TOTAL_REPLICAS=4, POPDIST_NUM_IPUS_PER_REPLICA=2,
        POPDIST_NUM_LOCAL_REPLICAS=2, POPDIST_UNIFORM_REPLICAS_PER_INSTANCE=1,
        POPDIST_REPLICA_INDEX_OFFSET=2, POPDIST_LOCAL_INSTANCE_INDEX=1)
    assert popdist.isPopdistEnvSet()
    assert popdist.getNumTotalReplicas() == 4
    assert popdist.getNumLocalReplicas() == 2
    assert popdist.getNumIpusPerReplica() == 2
    assert popdist.getReplicaIndexOffset() == 2
    assert popdist.getLocalInstanceIndex() == 1
    assert popdist.getNumInstances() == 2
    assert popdist.getInstanceIndex() == 1
    assert popdist.checkNumIpusPerReplica(2)
    assert not popdist.checkNumIpusPerReplica(1)
    assert popdist.getDeviceId() == 6  # 4 IPUs: 4 singles, 2 pairs, then the quad
    assert popdist.getDeviceId(4) == 14  # 8 IPUs: 8 + 4 + 2 smaller devices first


@settings(max_examples=60, deadline=None)
@given(num_instances=st.integers(1, 8), per_instance=st.integers(1, 4),
       ipus=st.sampled_from([1, 2, 4]), data=st.data())
def test_api_reads_back_what_the_launcher_sets(num_instances, per_instance, ipus, data):
    layout = Topology.build(["localhost"], num_instances * per_instance, ipus, num_instances)
    index = data.draw(st.integers(0, num_instances - 1))
    with pytest.MonkeyPatch.context() as patch:
        for name, value in layout.popdist_environment(index).items():
            patch.setenv(name, value)
        assert popdist.getInstanceIndex() == index
        assert popdist.getNumInstances() == num_instances
        assert popdist.getNumLocalReplicas() == per_instance
        assert popdist.getReplicaIndexOffset() == index * per_instance
        assert popdist.getNumTotalReplicas() == num_instances * per_instance
        assert popdist.getNumIpusPerReplica() == ipus
        assert popdist.getLocalInstanceIndex() == index


@pytest.mark.parametrize("variables, culprit", [
    ({"POPDIST_NUM_TOTAL_REPLICAS": "four"}, "POPDIST_NUM_TOTAL_REPLICAS='four'"),
    ({"POPDIST_NUM_LOCAL_REPLICAS": "0"}, "POPDIST_NUM_LOCAL_REPLICAS='0'"),
    ({"POPDIST_NUM_IPUS_PER_REPLICA": "-2"}, "POPDIST_NUM_IPUS_PER_REPLICA='-2'"),
    ({"POPDIST_REPLICA_INDEX_OFFSET": "1.5"}, "POPDIST_REPLICA_INDEX_OFFSET='1.5'"),
    ({"POPDIST_LOCAL_INSTANCE_INDEX": ""}, "POPDIST_LOCAL_INSTANCE_INDEX=''"),
    ({"POPDIST_UNIFORM_REPLICAS_PER_INSTANCE": "maybe"}, "is not a boolean"),
    ({"POPDIST_NUM_TOTAL_REPLICAS": "2", "POPDIST_NUM_LOCAL_REPLICAS": "4"}, "exceeds"),
    ({"POPDIST_NUM_TOTAL_REPLICAS": "6", "POPDIST_NUM_LOCAL_REPLICAS": "4"},
     "is not a multiple of POPDIST_NUM_LOCAL_REPLICAS=4"),
    ({"POPDIST_NUM_TOTAL_REPLICAS": "8", "POPDIST_NUM_LOCAL_REPLICAS": "4",
      "POPDIST_REPLICA_INDEX_OFFSET": "2"}, "POPDIST_REPLICA_INDEX_OFFSET=2 is not a multiple"),
    ({"POPDIST_NUM_TOTAL_REPLICAS": "8", "POPDIST_NUM_LOCAL_REPLICAS": "4",
      "POPDIST_REPLICA_INDEX_OFFSET": "8"}, "beyond POPDIST_NUM_TOTAL_REPLICAS=8"),
])
def test_bad_environment_values_name_the_variable(env, variables, culprit):
    env(**variables)
    with pytest.raises(popdist.PopdistEnvironmentError, match=culprit.replace(".", r"\.")):
        popdist.getNumLocalReplicas()
    assert isinstance(popdist.PopdistEnvironmentError("x"), ValueError)


def test_non_uniform_replicas(env):
    env(POPDIST_NUM_TOTAL_REPLICAS=5, POPDIST_NUM_LOCAL_REPLICAS=3,
        POPDIST_REPLICA_INDEX_OFFSET=2, POPDIST_UNIFORM_REPLICAS_PER_INSTANCE=0)
    assert not popdist.isUniformReplicasPerInstance()
    assert popdist.getNumLocalReplicas() == 3 and popdist.getReplicaIndexOffset() == 2
    with pytest.raises(RuntimeError, match="getNumInstances.*POPDIST_UNIFORM"):
        popdist.getNumInstances()
    with pytest.raises(RuntimeError, match="getInstanceIndex"):
        popdist.getInstanceIndex()


def test_argument_checks(env):
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(ValueError, match="positive integer"):
            popdist.checkNumIpusPerReplica(bad)
    with pytest.raises(ValueError, match="ipusPerReplica >= 0"):
        popdist.getDeviceId(-1)
    env(POPDIST_NUM_TOTAL_REPLICAS=3, POPDIST_NUM_LOCAL_REPLICAS=3)
    with pytest.raises(ValueError, match="3 IPUs .*power of two"):
        popdist.getDeviceId()


def test_execute_on_instances_without_process_group(env):
    calls = []

    def save(path, *, tag):
        calls.append((path, tag))
        return f"saved {path}"

    assert popdist.execute_on_instances({0}, save, "ckpt.pt", tag=3) == "saved ckpt.pt"
    assert calls == [("ckpt.pt", 3)]
    env(POPDIST_NUM_TOTAL_REPLICAS=4, POPDIST_NUM_LOCAL_REPLICAS=2,
        POPDIST_REPLICA_INDEX_OFFSET=0)
    assert popdist.execute_on_instances([1], save, "other.pt", tag=4) is None
    assert calls == [("ckpt.pt", 3)]
    assert popdist.current_group() is None


def test_execute_on_instances_rejects_bad_instances(env):
    env(POPDIST_NUM_TOTAL_REPLICAS=2, POPDIST_NUM_LOCAL_REPLICAS=1)
    with pytest.raises(ValueError, match=r"instances \[2\] do not exist.*0 to 1"):
        popdist.execute_on_instances({0, 2}, print)
    with pytest.raises(TypeError, match=r"collection of instance indices, e\.g\. \{0\}"):
        popdist.execute_on_instances(0, print)
    with pytest.raises(ValueError, match="at least one"):
        popdist.execute_on_instances(set(), print)


def test_init_is_a_no_op_for_one_instance_and_needs_the_rendezvous_otherwise(env, monkeypatch):
    popdist.init()  # single instance: nothing to join
    env(POPDIST_NUM_TOTAL_REPLICAS=2, POPDIST_NUM_LOCAL_REPLICAS=1)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(RuntimeError, match="MASTER_ADDR and MASTER_PORT.*poprun"):
        popdist.init()


@pytest.mark.slow
def test_init_and_execute_on_instances_across_real_instances(tmp_path):
    program = tmp_path / "collective.py"
    program.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        import popdist

        popdist.init()
        popdist.init()  # a second call keeps the existing process group

        def reduce_among_participants(scale):
            value = torch.tensor([float(popdist.getInstanceIndex() + 1)])
            dist.all_reduce(value, group=popdist.current_group())
            return scale * value.item()

        results = [popdist.execute_on_instances({1, 2}, reduce_among_participants, 10),
                   popdist.execute_on_instances({0}, reduce_among_participants, 1),
                   popdist.execute_on_instances([2, 1], reduce_among_participants, 2)]
        print(f"instance {popdist.getInstanceIndex()} of {dist.get_world_size()}: {results}")
    """))
    done = subprocess.run(
        [sys.executable, "-m", "popdist.poprun", "--num-instances", "3", "--num-replicas", "3",
         sys.executable, str(program)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)  # (a hang guard)
    assert done.returncode == 0, done.stderr
    lines = sorted(done.stdout.splitlines())
    assert lines == ["instance 0 of 3: [None, 1.0, None]", "instance 1 of 3: [50.0, None, 10.0]",
                     "instance 2 of 3: [50.0, None, 10.0]"]
