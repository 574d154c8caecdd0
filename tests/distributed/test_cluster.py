"""Where a rank says it runs, from each launcher's environment (no process group needed)."""

from codegeex_train.distributed.cluster import expected_node_of_rank, rank_env_from_slurm, this_rank_place


def test_node_identity_per_launcher():
    torchrun = {"RANK": "5", "LOCAL_RANK": "1", "GROUP_RANK": "2", "LOCAL_WORLD_SIZE": "2"}
    place = this_rank_place(torchrun)
    assert (place.rank, place.local_rank, place.node_rank, place.node) == (5, 1, 2, "node 2")
    slurm = {"RANK": "9", "LOCAL_RANK": "1", "SLURM_NODEID": "4", "SLURMD_NODENAME": "gpu-017"}
    place = this_rank_place(slurm)
    assert (place.node_rank, place.node) == (4, "gpu-017")
    # No launcher variables at all: contiguous blocks of the local world size.
    assert this_rank_place({"RANK": "7", "LOCAL_WORLD_SIZE": "4"}).node_rank == 1


def test_expected_nodes_of_missing_ranks():
    assert expected_node_of_rank(4, {"LOCAL_WORLD_SIZE": "2"}) == {0: "node 0", 1: "node 0", 2: "node 1",
                                                                   3: "node 1"}


def test_srun_environment_becomes_the_rank_environment():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}
    rank_env_from_slurm(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("3", "8", "1")
    launcher_set = {"RANK": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}
    rank_env_from_slurm(launcher_set)  # a launcher inside the allocation already set RANK: it wins
    assert launcher_set["RANK"] == "0" and "WORLD_SIZE" not in launcher_set
