"""Tier implementations behind one contract (see ``base.Tier``)."""
