"""calc_x: arithmetic word problems solved with a calculator tool by al.ToolAgent."""
