package iscsi

// parseRecord returns the values of a record, the last line of a name
// winning as in open-iscsi. berth itself edits records line by line
// (recordLines); the tests read them whole.
func parseRecord(rec []byte) map[string]string {
	m := map[string]string{}
	for _, s := range recordLines(rec) {
		m[s.name] = s.value
	}
	return m
}
