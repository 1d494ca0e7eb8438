"""The Ray session of every entry point (ray_cluster_ft.pipeline.session): a new local Ray unless an address is
given, fast failure on a dead address or an impossible world size, and Ray shut down where it was started (also
on an interrupt, where it was only joined)."""

from __future__ import annotations

import pytest

from ray_cluster_ft.config import parse_config


def test_unreachable_ray_address_fails_fast():
    import time

    from ray_cluster_ft.config import ConfigError
    from ray_cluster_ft.pipeline.session import check_reachable as _check_reachable

    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="cannot reach a Ray cluster at '127.0.0.1:1'"):
        _check_reachable("127.0.0.1:1")
    with pytest.raises(ConfigError, match="ray://127.0.0.1:1"):
        _check_reachable("ray://127.0.0.1:1")
    assert time.perf_counter() - t0 < 15
    _check_reachable("auto")  # resolved by Ray itself


def test_world_size_beyond_local_resources_is_refused(monkeypatch):
    import ray

    from ray_cluster_ft.config import ConfigError
    from ray_cluster_ft.pipeline.session import check_local_resources as _check_local_resources

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    _check_local_resources(parse_config({"train": {"num_workers": 2}}))
    with pytest.raises(ConfigError, match=r"num_workers=64 x train.cpus_per_worker=1 = 64 CPUs, but the local Ray has 2"):
        _check_local_resources(parse_config({"train": {"num_workers": 64}}))
    with pytest.raises(ConfigError, match="0 GPUs"):
        _check_local_resources(parse_config({"train": {"num_workers": 1, "use_gpu": True}}))


def test_no_address_starts_a_new_local_ray_and_an_address_joins(monkeypatch):
    """A plain ``ray.init()`` joins whatever /tmp/ray/ray_current_cluster names (a dead cluster left by a crashed
    ``ray start`` made runs hang); without --address and $RAY_ADDRESS the run asks for a new local Ray."""
    import ray

    from ray_cluster_ft.pipeline.session import init_ray

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", raising=False)
    monkeypatch.delenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", raising=False)
    assert init_ray(None, use_gpu=False) is True
    assert calls[-1]["address"] == "local"
    assert calls[-1]["runtime_env"] == {"env_vars": {"DS_ACCELERATOR": "cpu", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
                                                     "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}}
    assert init_ray("auto", use_gpu=True) and calls[-1]["address"] == "auto"
    assert calls[-1]["runtime_env"] == {"env_vars": {}}  # a joined cluster keeps Ray Train's own settings
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    assert init_ray(None, use_gpu=False) and calls[-1]["address"] == "auto"
    assert calls[-1]["runtime_env"] == {"env_vars": {"DS_ACCELERATOR": "cpu"}}


def test_a_local_ray_takes_the_users_ray_train_settings_over_its_own(monkeypatch):
    import ray

    from ray_cluster_ft.pipeline.session import init_ray

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "3")
    monkeypatch.delenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", raising=False)
    assert init_ray(None, use_gpu=True)
    # Ray Train passes the driver's own value to its controller; the session adds only what the user left unset.
    assert calls[-1]["runtime_env"] == {"env_vars": {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}}


def test_a_local_rays_dashboard_is_on_unless_the_variable_turns_it_off(monkeypatch):
    import ray

    from ray_cluster_ft.config import ConfigError
    from ray_cluster_ft.pipeline.session import init_ray

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_CLUSTER_FT_LOCAL_DASHBOARD", raising=False)
    assert init_ray(None, use_gpu=False) and "include_dashboard" not in calls[-1]  # Ray's default: a dashboard
    monkeypatch.setenv("RAY_CLUSTER_FT_LOCAL_DASHBOARD", "0")
    assert init_ray(None, use_gpu=False) and calls[-1]["include_dashboard"] is False
    port = calls[-1]["dashboard_port"]
    assert port != 8265 and 0 < port < 65536  # not the address another Ray's dashboard answers on
    assert init_ray("auto", use_gpu=False) and "include_dashboard" not in calls[-1]  # a joined cluster: untouched
    monkeypatch.setenv("RAY_CLUSTER_FT_LOCAL_DASHBOARD", "off")
    with pytest.raises(ConfigError, match="RAY_CLUSTER_FT_LOCAL_DASHBOARD must be 0"):
        init_ray(None, use_gpu=False)


def test_ray_session_shuts_down_what_it_started_and_on_an_interrupt_what_it_joined(monkeypatch):
    import ray

    from ray_cluster_ft.pipeline import session

    calls = []
    monkeypatch.setattr(session, "init_ray", lambda address, use_gpu: address == "new")
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    with session.ray_session("new") as started:
        assert started is True
    assert calls == ["shutdown"]
    with session.ray_session("joined") as started:
        assert started is False
    assert calls == ["shutdown"]  # a joined Ray is left running
    with pytest.raises(KeyboardInterrupt), session.ray_session("joined"):
        raise KeyboardInterrupt
    assert calls == ["shutdown", "shutdown"]  # the driver's actors and workers must stop now
