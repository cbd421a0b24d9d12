import ray


@ray.remote
def _square(x):
    return x * x


def test_local_ray_runs_tasks(ray_local):
    assert ray.get([_square.remote(i) for i in range(4)]) == [0, 1, 4, 9]
    assert ray.cluster_resources()["GPU"] == 4


def test_two_node_cluster(ray_multinode):
    ray_multinode([{"num_cpus": 1}, {"num_cpus": 1, "num_gpus": 2}])
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    assert ray.cluster_resources()["GPU"] == 2
