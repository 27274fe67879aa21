"""Torch threads by the work of a training step: counted multiply-adds, not timings."""

from __future__ import annotations

import torch
from torch import nn

from device_agent.compute_threads import (
    MACS_PER_THREAD,
    StepThreads,
    forward_macs,
    largest_step_macs,
    step_macs,
    threads_for,
    torch_threads,
    useful_threads,
)


def test_linear_layers_count_inputs_times_outputs_per_sample() -> None:
    model = nn.Sequential(nn.Linear(60, 32), nn.ReLU(), nn.Linear(32, 10))
    assert forward_macs(model, torch.zeros(10, 60)) == 10 * (60 * 32 + 32 * 10)


def test_a_convolution_counts_its_kernel_at_every_output_position() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 8, kernel_size=3, padding=1), nn.Flatten(), nn.Linear(8 * 16, 2)
    )
    # 8 channels x 4x4 positions, each 3 x 3 x 3 multiply-adds; then the linear head
    assert forward_macs(model, torch.zeros(2, 3, 4, 4)) == 2 * (8 * 16 * 27 + 128 * 2)


def test_other_parameters_count_once_per_sample_and_hooks_are_removed() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    assert forward_macs(model, torch.zeros(3, 4)) == 3 * 16 + 3 * 8  # LayerNorm: 8 parameters
    assert all(not layer._forward_hooks for layer in model.modules())


def test_small_steps_get_one_thread_and_big_ones_one_per_share_up_to_the_cores() -> None:
    assert useful_threads(0, 8) == 1
    assert useful_threads(MACS_PER_THREAD - 1, 8) == 1
    assert useful_threads(3 * MACS_PER_THREAD, 8) == 3
    assert useful_threads(100 * MACS_PER_THREAD, 8) == 8
    assert useful_threads(100 * MACS_PER_THREAD, 1) == 1


def test_threads_are_set_inside_and_restored_after() -> None:
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_a_step_counts_one_sample_of_the_first_data_that_has_one_times_the_batch() -> None:
    model = nn.Linear(6, 2)
    assert step_macs(model, [torch.zeros(0, 6), torch.zeros(5, 6)], batch_size=10) == 10 * 12
    assert step_macs(model, [torch.zeros(0, 6)], batch_size=10) == 0


def test_a_device_choice_counts_one_sample_and_scales_with_the_batch_up_to_its_cores() -> None:
    # 1000 x 1000 multiply-adds a sample: a thread per 8 samples, at most 3
    choice = StepThreads(nn.Linear(1000, 1000), [torch.zeros(4, 1000)], cores=3)
    assert choice.per_sample == 1_000_000
    assert [choice(batch) for batch in (1, 7, 8, 16, 64)] == [1, 1, 1, 2, 3]
    with threads_for(choice, 16):
        assert torch.get_num_threads() == 2
    before = torch.get_num_threads()
    with threads_for(None, 16):  # no choice: the process's setting stands
        assert torch.get_num_threads() == before


def test_the_largest_step_holds_at_most_the_largest_devices_data() -> None:
    model = nn.Linear(6, 2)  # 12 multiply-adds a sample
    inputs = [torch.zeros(3, 6), torch.zeros(7, 6)]
    assert largest_step_macs(model, inputs, batch_size=5) == 5 * 12
    assert largest_step_macs(model, inputs, batch_size=50) == 7 * 12
    assert largest_step_macs(model, [], batch_size=50) == 0
