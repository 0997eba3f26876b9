"""megaslide.plan and megaslide-plan: the 105B model at 81x720x1280 on one
H200 (fits with all persistent state on the host; does not fit 24 GB),
budget units, argument checking, policies and the HTML report.

The 105B plans take a few seconds each, so each is computed once per
module and shared."""

import json
import pathlib
import re
import subprocess

import pytest

import megaslide

VIDEO_105B = ("megaslide-105b", 81, 720, 1280)
TINY = ("tiny", 5, 32, 32)
VIDEO_ARGS_105B = ["--model", "megaslide-105b", "--frames", "81",
                   "--height", "720", "--width", "1280"]
VIDEO_ARGS_TINY = ["--model", "tiny", "--frames", "5", "--height", "32",
                   "--width", "32"]
# Categories of persistent training state (PlanReport host categories).
PERSISTENT = ("fp32 master weights", "AdamW moments")


@pytest.fixture(scope="module")
def plan_141gb():
    return megaslide.plan(*VIDEO_105B, gpu_mem="141GB", host_mem="1.5TB")


@pytest.fixture(scope="module")
def plan_24gb():
    return megaslide.plan(*VIDEO_105B, gpu_mem="24GB", host_mem="1.5TB")


def run_plan(tool, *args):
    return subprocess.run([tool, *args], capture_output=True, text=True,
                          timeout=120)


# --- 105B on one H200 -------------------------------------------------------

def test_105b_fits_an_h200_with_every_persistent_byte_on_the_host(plan_141gb):
    plan = plan_141gb
    assert plan["fits"] is True
    assert plan["violations"] == []
    assert plan["budgets"]["gpu_bytes"] == 141_000_000_000
    assert plan["budgets"]["host_bytes"] == 1_500_000_000_000

    host, device = plan["host"], plan["device"]
    assert host["total_bytes"] <= 1.5e12
    # The project's target: at most ~12.5 host bytes per parameter for
    # what MegaSlide holds (the OS allowance is the machine's, not ours).
    allowance = host["by_category"]["OS and runtime allowance"]
    assert host["bytes_per_param"] <= 12.5
    assert host["bytes_per_param"] == pytest.approx(
        (host["total_bytes"] - allowance) / plan["params"]["total"], rel=1e-12)
    assert host["total_bytes"] == sum(host["by_category"].values())
    # fp32 master (4 B) and AdamW m + v (8 B) of every trainable parameter
    # live on the host, and nothing of them on the device.
    trainable = plan["params"]["trainable"]
    assert host["by_category"]["fp32 master weights"] == 4 * trainable
    assert host["by_category"]["AdamW moments"] == 8 * trainable
    for category in device["by_category"]:
        lowered = category.lower()
        assert "master" not in lowered and "moment" not in lowered, category
    assert not set(PERSISTENT) & set(device["by_category"])

    assert device["peak_bytes"] <= 141e9
    # The device peak leaves the runtime its reserve.
    assert (device["peak_bytes"]
            <= plan["budgets"]["gpu_bytes"] - plan["budgets"]["gpu_reserve_bytes"])


def test_105b_step_time_is_near_its_lower_bound(plan_141gb):
    step = plan_141gb["step"]
    lower, predicted = step["lower_bound_seconds"], step["predicted_seconds"]
    assert 0 < lower <= predicted
    assert predicted <= 1.05 * lower, (predicted, lower)
    # The bound is the busiest stream.
    assert lower == pytest.approx(max(step["busy_seconds"].values()))


def test_105b_compute_time_splits_by_kernel_family(plan_141gb):
    """step.by_kernel_family (docs/CostModel.md, "Kernel families") adds up
    to the compute stream's busy time; the GEMMs dominate, and the 3D-DSA
    kernels replace dense self-attention."""
    step = plan_141gb["step"]
    families = step["by_kernel_family"]
    assert set(families) <= {"gemm", "attention_fwd", "attention_bwd",
                             "dsa3d_fwd", "dsa3d_bwd", "dsa3d_offsets",
                             "elementwise"}
    total = sum(f["seconds"] for f in families.values())
    assert total == pytest.approx(step["busy_seconds"]["compute"], rel=1e-9)
    assert max(families, key=lambda f: families[f]["seconds"]) == "gemm"
    assert families["dsa3d_bwd"]["seconds"] > families["dsa3d_fwd"]["seconds"]
    assert sum(f["flops"] for f in families.values()) == step["device_flops"]


def test_105b_does_not_fit_24gb_and_says_why(plan_24gb):
    plan = plan_24gb
    # Over budget is a result, not an exception.
    assert plan["fits"] is False
    assert plan["violations"], plan["violations"]
    assert any("device memory plan needs" in v for v in plan["violations"])
    assert plan["budgets"]["gpu_bytes"] == 24_000_000_000
    assert plan["device"]["peak_bytes"] > 24e9
    # Auto has already offloaded every block's checkpoint.
    assert set(plan["policies"]["activation"]) == {"offload"}


def test_megaslide_plan_exit_status(megaslide_plan, tmp_path, plan_141gb):
    report = tmp_path / "fits.json"
    fits = run_plan(megaslide_plan, *VIDEO_ARGS_105B, "--gpu-mem", "141GB",
                    "--host-mem", "1.5TB", "--format", "json", "-o",
                    str(report))
    assert fits.returncode == 0, fits.stderr
    tool = json.loads(report.read_text())
    # The tool and the Python module plan the same step.
    assert tool["fits"] is True
    for key in ("peak_bytes", "by_category"):
        assert tool["device"][key] == plan_141gb["device"][key]
    assert tool["host"] == plan_141gb["host"]

    over = run_plan(megaslide_plan, *VIDEO_ARGS_105B, "--gpu-mem", "24GB",
                    "--host-mem", "1.5TB")
    assert over.returncode == 3, over.stderr
    assert "device memory plan needs" in over.stderr


# --- Budgets and arguments --------------------------------------------------

def test_decimal_and_binary_units_differ():
    gib = megaslide.plan(*TINY, gpu_mem="80GiB")["budgets"]
    gb = megaslide.plan(*TINY, gpu_mem="80GB")["budgets"]
    assert gib["gpu_bytes"] == 85_899_345_920
    assert gb["gpu_bytes"] == 80_000_000_000
    tib = megaslide.plan(*TINY, host_mem="1.5TiB", gpu_reserve="512MiB")
    assert tib["budgets"]["host_bytes"] == 1_649_267_441_664
    assert tib["budgets"]["gpu_reserve_bytes"] == 536_870_912


@pytest.mark.parametrize("kwargs", [
    dict(bogus=1),                    # unknown option
    dict(gpumem="141GB"),             # misspelt option
    dict(gpu_mem=141),                # budgets are strings with units
    dict(host_mem=1.5e12),
    dict(buffers="2"),
    dict(buffers=True),               # bool is not an int here
    dict(prefetch_distance=1.0),
    dict(activation_policy=None),
    dict(host_state_policy=["bf16-moments"]),
])
def test_bad_option_names_and_types_raise_type_error(kwargs):
    with pytest.raises(TypeError):
        megaslide.plan(*TINY, **kwargs)


@pytest.mark.parametrize("option", ["gpu_mem", "host_mem"])
def test_zero_budgets_are_refused(option):
    with pytest.raises(ValueError, match="a budget must be positive"):
        megaslide.plan(*TINY, **{option: "0GB"})


def test_zero_reserve_and_allowance_are_allowed():
    result = megaslide.plan(*TINY, gpu_reserve="0B", os_allowance="0GB")
    assert result["budgets"]["gpu_reserve_bytes"] == 0
    assert "OS and runtime allowance" in result["host"]["by_category"]


def test_bad_model_argument_types_raise_type_error():
    with pytest.raises(TypeError):
        megaslide.plan(3, 5, 32, 32)
    with pytest.raises(TypeError):
        megaslide.plan("tiny", 5.0, 32, 32)


@pytest.mark.parametrize("kwargs,option", [
    (dict(gpu_mem="lots"), "gpu[-_]mem"),
    (dict(gpu_mem="141 GBs"), "gpu[-_]mem"),
    (dict(host_mem="1.5 parsecs"), "host[-_]mem"),
    (dict(gpu_reserve="2 gibibytes"), "gpu[-_]reserve"),
    (dict(os_allowance="-3GB"), "os[-_]allowance"),
])
def test_bad_units_raise_value_error_naming_the_option(kwargs, option):
    # The option is named as the tool spells it (gpu-mem) or as Python does
    # (gpu_mem); either tells the user which argument to fix.
    with pytest.raises(ValueError, match=rf"'{option}'.*is not a memory size"):
        megaslide.plan(*TINY, **kwargs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(activation_policy="sometimes"),
     "option 'activation-policy': unknown value 'sometimes'; use one of keep"),
    (dict(host_state_policy="nope"),
     "option 'host-state-policy': unknown value 'nope'; use one of master-moments"),
    (dict(buffers=0), "'buffers'"),
    (dict(prefetch_distance=-1), "'prefetch-distance'"),
    (dict(precision="fp16"),
     "option 'precision': unknown value 'fp16'; use one of bf16, f32"),
])
def test_bad_option_values_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        megaslide.plan(*TINY, **kwargs)


def test_unknown_attention_raises_value_error():
    with pytest.raises(ValueError, match="option 'attention': unknown value "
                                         "'local'; use one of dsa, global"):
        megaslide.plan(*TINY, attention="local")


def test_precision_f32_doubles_what_the_compute_type_sizes():
    bf16, f32 = megaslide.plan(*TINY), megaslide.plan(*TINY, precision="f32")
    assert (bf16["video"]["precision"], f32["video"]["precision"]) == (
        "bf16", "f32")
    assert f32["device"]["by_category"]["weights"] == (
        2 * bf16["device"]["by_category"]["weights"])
    assert f32["transfers"]["d2h_by_kind"]["gradients"] == (
        2 * bf16["transfers"]["d2h_by_kind"]["gradients"])
    for category in PERSISTENT:
        assert f32["host"]["by_category"][category] == (
            bf16["host"]["by_category"][category])


# --- Policies ---------------------------------------------------------------

def test_tiny_fits_with_every_activation_kept_under_auto():
    plan = megaslide.plan(*TINY)
    assert plan["fits"] is True
    assert plan["policies"]["activation"] == ["keep", "keep"]
    assert plan["policies"]["host_state"] == "master-moments"
    assert [layer["activation_policy"] for layer in plan["per_layer"]] == ["keep", "keep"]
    assert plan["host"]["by_category"]["offloaded checkpoints"] == 0


@pytest.mark.parametrize("policy", ["keep", "recompute", "offload"])
def test_fixed_activation_policies_are_applied(policy):
    plan = megaslide.plan(*TINY, activation_policy=policy)
    assert plan["policies"]["activation"] == [policy, policy]
    offloaded = plan["host"]["by_category"]["offloaded checkpoints"]
    assert (offloaded > 0) == (policy == "offload")


def test_host_state_policies_change_the_host_bytes():
    trainable = megaslide.plan(*TINY)["params"]["trainable"]
    narrow = megaslide.plan(*TINY, host_state_policy="bf16-moments")
    assert narrow["policies"]["host_state"] == "bf16-moments"
    assert narrow["host"]["by_category"]["AdamW moments"] == 4 * trainable
    assert narrow["host"]["by_category"]["fp32 master weights"] == 4 * trainable


# --- HTML report ------------------------------------------------------------

def test_html_report_is_self_contained(megaslide_plan, tmp_path):
    out = tmp_path / "plan.html"
    result = run_plan(megaslide_plan, *VIDEO_ARGS_TINY, "--format", "html",
                      "-o", str(out))
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert text.startswith("<!DOCTYPE html>")
    assert "<svg" in text
    # Nothing is fetched from the network: no scripts, fonts or styles by URL.
    assert "http" not in text


def test_dsa_window_options_reach_the_rewrite():
    # tiny's 2 x 2 x 2 grid is smaller than the default window: attention
    # stays global, with a remark saying why; a window that fits rewrites it.
    default = megaslide.plan(*TINY)
    assert any("kept global attention" in r for r in default["remarks"])
    fitted = megaslide.plan(*TINY, dsa_window=(2, 2, 2), dsa_tile=(1, 2, 2))
    assert not any("kept global attention" in r for r in fitted["remarks"])
    with pytest.raises(TypeError, match="three ints"):
        megaslide.plan(*TINY, dsa_window=(2, 2))


def test_a_jobs_report_gives_its_figures():
    """A job of 2 x 2 ranks (docs/Distributed.md, "Planning a job"): the
    report's `job` follows from its other figures and from the one-GPU
    plan of the same options; a one-GPU report has no job, no comm stream
    and no links."""
    one = megaslide.plan(*TINY)
    assert "job" not in one
    assert "comm" not in one["step"]["busy_seconds"]
    assert "nvlink_bandwidth" not in one["hardware"]
    report = megaslide.plan(*TINY, gpus_per_node=2, nodes=2)
    job = report["job"]
    assert (job["gpus_per_node"], job["nodes"], job["ranks"]) == (2, 2, 4)
    assert job["collective_seconds"] == report["step"]["busy_seconds"]["comm"]
    assert job["collective_seconds"] > 0
    assert report["hardware"]["network_bandwidth"] == 50e9
    # 2 (N - 1) network latencies.
    assert job["norm_allreduce_seconds"] == pytest.approx(2 * 3 * 6e-6)
    assert job["step_seconds_per_rank"] == pytest.approx(
        report["recipe"]["optimizer_step_seconds"] +
        job["norm_allreduce_seconds"])
    assert job["samples_per_second"] == pytest.approx(
        4 / job["step_seconds_per_rank"])
    assert job["one_gpu_step_seconds"] == \
        one["recipe"]["optimizer_step_seconds"]
    assert job["one_gpu_samples_per_second"] == pytest.approx(
        1 / job["one_gpu_step_seconds"])
    assert job["scaling_efficiency"] == pytest.approx(
        job["samples_per_second"] / (4 * job["one_gpu_samples_per_second"]))
    # A node: its two ranks' shares and the OS allowance once.
    allowance = one["host"]["by_category"]["OS and runtime allowance"]
    assert job["host_bytes_per_node"] == report["host"]["total_bytes"] == \
        2 * job["host_bytes_per_rank"] + allowance
    assert job["nodes_to_fit_host"] == 1 and job["advice"] == []
    # Each rank copies about 1/4 of one GPU's weights.
    weights = report["transfers"]["h2d_by_kind"]["weights"]
    whole = one["transfers"]["h2d_by_kind"]["weights"]
    assert whole / 4 <= weights < whole / 2


@pytest.mark.parametrize("option", ["gpus_per_node", "nodes"])
def test_a_job_of_no_ranks_is_refused_naming_the_option(option):
    name = option.replace("_", "-")
    with pytest.raises(ValueError, match=f"option '{name}' is 0; it must be "
                                         "at least 1"):
        megaslide.plan(*TINY, **{option: 0})


def test_a_jobs_advice_frees_a_nodes_share(megaslide_plan):
    """What a leaner host state frees is said per node: a node of 2 holds
    half of the job's state, so bf16 moments free it half as much."""
    def frees(*job):
        out = run_plan(megaslide_plan, "--model", "megaslide-105b",
                       "--frames", "81", "--height", "720", "--width", "1280",
                       "--host-mem", "700GB", *job).stdout
        found = re.search(r"bf16-moments \(frees ([\d.]+) GB", out)
        assert found, out
        return float(found[1])
    one, two = frees("--gpus-per-node", "8"), \
        frees("--gpus-per-node", "8", "--nodes", "2")
    assert two == pytest.approx(one / 2, rel=1e-3), (one, two)


def test_a_jobs_plan_replays_on_sim_and_is_refused_by_cpu():
    """The sim backend replays a job's plan as the planner does (each rank
    with its share of the node's host); the cpu backend refuses it naming
    its first collective (exec::checkOneRank)."""
    planned = megaslide.plan(*TINY, gpus_per_node=2)
    trainer = megaslide.Trainer(*TINY, backend="sim", gpus_per_node=2)
    assert trainer.step()["seconds"] == planned["step"]["predicted_seconds"]
    with pytest.raises(ValueError, match=r"the cpu backend cannot run "
                                         r"instruction #\d+ \('all_gather' "
                                         r"over 2 ranks\)"):
        megaslide.Trainer(*TINY, backend="cpu", gpus_per_node=2)


def test_html_report_shows_a_job(megaslide_plan, tmp_path):
    out = tmp_path / "job.html"
    result = run_plan(megaslide_plan, *VIDEO_ARGS_TINY, "--gpus-per-node",
                      "2", "--format", "html", "-o", str(out))
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert "<h2>Job: 2 ranks, 1 node(s) of 2 GPUs</h2>" in text
    assert "Scaling efficiency" in text and ">comm<" in text
    one = tmp_path / "one.html"
    run_plan(megaslide_plan, *VIDEO_ARGS_TINY, "--format", "html", "-o",
             str(one))
    assert "<h2>Job" not in one.read_text() and ">comm<" not in \
        one.read_text()


def test_a_job_defers_its_updates(megaslide_plan):
    # A job's gradient is the ranks' sum: update=auto defers, and a
    # streaming job is refused (the runtime could not run it).
    result = run_plan(megaslide_plan, *VIDEO_ARGS_TINY, "--gpus-per-node",
                      "2", "--format", "json")
    recipe = json.loads(result.stdout)["recipe"]
    assert recipe["update"] == "deferred", recipe
    assert "a job of 2 ranks needs the deferred update" in recipe["reason"]
    refused = subprocess.run(
        [megaslide_plan, *VIDEO_ARGS_TINY, "--gpus-per-node", "2",
         "--update", "streaming"], capture_output=True, text=True)
    assert refused.returncode == 1
    assert "a job of 2 ranks sums every gradient over the ranks" in \
        refused.stderr, refused.stderr
