"""Engine backends behind one Protocol (``workers.engines.base.Engine``)."""
