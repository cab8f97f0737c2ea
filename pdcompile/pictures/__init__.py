"""Pictures: Gantt charts of timelines (`gantt`) and graph drawings coloured by a plan
(`stage_colours`), used by the CLI and by `Simulation.plot`."""
