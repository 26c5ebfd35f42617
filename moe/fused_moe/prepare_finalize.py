"""Prepare/finalize of the modular kernel: one ``FusedMoEPrepareAndFinalize`` per communication
pattern, defined with the expert all-to-all in ``distributed.all2all`` and named here for the
model side."""

from distributed import FusedMoEPrepareAndFinalize, NoEPPrepareAndFinalize

__all__ = ["FusedMoEPrepareAndFinalize", "NoEPPrepareAndFinalize"]
