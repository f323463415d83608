package iscsi

import "strings"

// parseRecord returns the values of a record, the last line of a name
// winning as in open-iscsi. berth itself edits records line by line
// (setRecordValues); the tests read them whole.
func parseRecord(rec []byte) map[string]string {
	m := map[string]string{}
	for _, s := range recordLines(rec) {
		m[s.name] = s.value
	}
	return m
}

// recordLines returns the "name = value" lines of a record in order,
// values trimmed; comments and other lines are skipped.
func recordLines(rec []byte) []setting {
	var set []setting
	for _, line := range strings.Split(string(rec), "\n") {
		line = strings.TrimSpace(line)
		name, ok := recordKey(line)
		if !ok {
			continue
		}
		rest := strings.TrimLeft(line[len(name):], " \t")
		if !strings.HasPrefix(rest, "=") {
			continue
		}
		set = append(set, setting{name, strings.TrimSpace(rest[1:])})
	}
	return set
}
