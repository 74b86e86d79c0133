"""The `route` of a quantized layer: which of its C++ kernel's routes it takes, forced or chosen.

QuantLinear (int8 / int4, quant/linear.py) and KQuantLinear (GGUF K-quants, quant/kquant.py) each pass a
route id to their kernel: "auto" lets the kernel choose by row count (quant/routing.py sets where the
int8-activation tiles stop), the others force one route, so tests run every route on any CPU; "torch" is
the float reference path (id -1: the kernel is not called).
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from tokenloom.errors import ConfigError


class RoutedLayer(nn.Module):
    """A quantized layer whose kernel route can be forced, so tests run every route on any CPU: `route` is
    one of KERNEL_ROUTES (the names of the C++ kernel's route ids; "auto" lets it choose as above) or "torch"
    (the float reference path, `_route_id` -1)."""

    KERNEL_ROUTES: ClassVar[dict[str, int]] = {}
    ROUTE_LABEL: ClassVar[str] = "quantized layer"  # names the layer kind in the error

    @property
    def route(self) -> str:
        return self._route

    @route.setter
    def route(self, value: str) -> None:
        routes = (*self.KERNEL_ROUTES, "torch")
        if value not in routes:
            raise ConfigError(f"{self.ROUTE_LABEL} route must be one of {', '.join(routes)}, got {value!r}")
        self._route = value
        self._route_id = self.KERNEL_ROUTES.get(value, -1)
