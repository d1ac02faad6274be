"""Reading a capture: the reader (`reader`), chunks decompressed on any thread (`inflate`) and ahead of the
code that reads them (`read_ahead`), what could not be read (`damage`), salvage (`recover`), and what a command
line names (`sets`, `step_range`)."""
