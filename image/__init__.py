"""The appliance image: `build` makes the raw GPT disk image (`just image`), `firstboot` runs on
it at boot, and `system/` holds the files laid over its Debian root (systemd units, fstab)."""
