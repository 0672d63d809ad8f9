NAME = "helper imported"
