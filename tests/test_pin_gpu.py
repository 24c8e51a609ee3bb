"""kerasdist.pin_gpu's choice of GPU, on a stand-in for tf.config (this machine has no GPU)."""

import pytest

from kerasdist import devices


class FakeConfig:
    """Records what pin_gpu asks of tf.config."""

    def __init__(self, gpus):
        self.gpus = gpus
        self.visible = None
        self.growth = {}
        self.experimental = self

    def list_physical_devices(self, device_type):
        assert device_type == "GPU"
        return list(self.gpus)

    def set_visible_devices(self, devices, device_type):
        assert device_type == "GPU"
        self.visible = devices

    def set_memory_growth(self, device, enable):
        self.growth[device] = enable


def test_each_local_rank_sees_only_its_own_gpu_with_memory_growth():
    for local_rank in range(4):
        config = FakeConfig(["gpu0", "gpu1", "gpu2", "gpu3"])
        assert devices._pin_gpu(config, local_rank, 4) == f"gpu{local_rank}"
        assert config.visible == [f"gpu{local_rank}"]
        assert config.growth == {f"gpu{local_rank}": True}


def test_without_gpus_nothing_changes():
    config = FakeConfig([])
    assert devices._pin_gpu(config, 1, 2) is None
    assert config.visible is None and config.growth == {}


def test_more_processes_than_gpus_is_an_error_naming_the_counts():
    config = FakeConfig(["gpu0", "gpu1"])
    with pytest.raises(RuntimeError, match="local rank 2 has no GPU of its own: this host has 2 GPU"):
        devices._pin_gpu(config, 2, 3)
    assert config.visible is None


def test_pin_gpu_on_this_machine_returns_none_or_a_gpu():
    import kerasdist

    gpu = kerasdist.pin_gpu()
    assert gpu is None or gpu.device_type == "GPU"
