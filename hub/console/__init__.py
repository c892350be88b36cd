"""The hub's web console (`/console/`): server-rendered pages for operators, with
logins of their own (`kvl hub admin create`). Wiring in `hub.console.app`."""
