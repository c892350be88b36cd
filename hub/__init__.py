"""The Kovenlab Edge hub: enrollment, fleet inventory, placement, quota, burst offload, console."""
