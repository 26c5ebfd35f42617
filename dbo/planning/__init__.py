"""The DBO planner: whether and where micro-batch overlap pays, predicted per batch shape and
number of ubatches from a cost model (``RooflineCostModel`` from device, link and model presets,
or ``CalibratedCostModel`` fitted to one of our timelines) and the overlap schedule
(``schedule``); ``planner`` turns them into speedups, crossovers and thresholds, ``report`` into
what ``launch.plan`` prints, ``sweep`` checks it on links it was not calibrated on. Pure Python:
it reads timelines and a model's config, never runs a model (docs/planner.md)."""

from dbo.planning.calibrated_model import CalibratedCostModel, calibrate
from dbo.planning.devices import DeviceSpec, resolve_device
from dbo.planning.links import LinkModel, deepep_link, from_gbps
from dbo.planning.planner import Prediction, crossover, predict, recommend, step_ms
from dbo.planning.roofline_model import RooflineCostModel, Workload
from dbo.planning.schedule import LayerCosts, simulate_layers, simulate_sglang_decode

__all__ = [
    "CalibratedCostModel",
    "DeviceSpec",
    "LayerCosts",
    "LinkModel",
    "Prediction",
    "RooflineCostModel",
    "Workload",
    "calibrate",
    "crossover",
    "deepep_link",
    "from_gbps",
    "predict",
    "recommend",
    "resolve_device",
    "simulate_layers",
    "simulate_sglang_decode",
    "step_ms",
]
