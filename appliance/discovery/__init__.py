"""LAN discovery: the appliance announces itself over mDNS/DNS-SD (zeroconf)."""
