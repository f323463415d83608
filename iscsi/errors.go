package iscsi

import (
	"github.com/berth-csi/berth/internal/errdefs"
)

// Exit codes of iscsiadm, from open-iscsi's include/iscsi_err.h.
const (
	ISCSI_ERR                        = 1  // generic error
	ISCSI_ERR_SESS_NOT_FOUND         = 2  // session could not be found
	ISCSI_ERR_NOMEM                  = 3  // out of memory
	ISCSI_ERR_TRANS                  = 4  // transport error
	ISCSI_ERR_LOGIN                  = 5  // generic login failure
	ISCSI_ERR_IDBM                   = 6  // error accessing the record database
	ISCSI_ERR_INVAL                  = 7  // invalid argument
	ISCSI_ERR_TRANS_TIMEOUT          = 8  // connection timer expired while connecting
	ISCSI_ERR_INTERNAL               = 9  // generic iscsid failure
	ISCSI_ERR_LOGOUT                 = 10 // logout failed
	ISCSI_ERR_PDU_TIMEOUT            = 11 // iSCSI PDU timed out
	ISCSI_ERR_TRANS_NOT_FOUND        = 12 // transport module not loaded
	ISCSI_ERR_ACCESS                 = 13 // permission denied
	ISCSI_ERR_TRANS_CAPS             = 14 // transport cannot do the operation
	ISCSI_ERR_SESS_EXISTS            = 15 // session is logged in
	ISCSI_ERR_INVALID_MGMT_REQ       = 16 // invalid IPC request
	ISCSI_ERR_ISNS_UNAVAILABLE       = 17 // iSNS not supported
	ISCSI_ERR_ISCSID_COMM_ERR        = 18 // a read or write to iscsid failed
	ISCSI_ERR_FATAL_LOGIN            = 19 // fatal login error (target refused)
	ISCSI_ERR_ISCSID_NOTCONN         = 20 // could not connect to iscsid
	ISCSI_ERR_NO_OBJS_FOUND          = 21 // no records, targets or sessions found
	ISCSI_ERR_SYSFS_LOOKUP           = 22 // sysfs lookup failed
	ISCSI_ERR_HOST_NOT_FOUND         = 23 // host lookup failed
	ISCSI_ERR_LOGIN_AUTH_FAILED      = 24 // authentication failed
	ISCSI_ERR_ISNS_QUERY             = 25 // iSNS query failed
	ISCSI_ERR_ISNS_REG_FAILED        = 26 // iSNS registration failed
	ISCSI_ERR_OP_NOT_SUPP            = 27 // operation not supported
	ISCSI_ERR_BUSY                   = 28 // device or resource in use
	ISCSI_ERR_AGAIN                  = 29 // retry may succeed
	ISCSI_ERR_UNKNOWN_DISCOVERY_TYPE = 30 // unknown discovery type
	ISCSI_ERR_CHILD_TERMINATED       = 31 // child process terminated
)

// exitMeaning names the exit codes iscsiadm users meet.
func exitMeaning(code int) string {
	switch code {
	case ISCSI_ERR_SESS_NOT_FOUND:
		return "session not found"
	case ISCSI_ERR_LOGIN:
		return "login failed"
	case ISCSI_ERR_IDBM:
		return "node record database error"
	case ISCSI_ERR_TRANS_TIMEOUT:
		return "connection timed out: is the portal reachable?"
	case ISCSI_ERR_PDU_TIMEOUT:
		return "iSCSI PDU timed out"
	case ISCSI_ERR_TRANS_NOT_FOUND:
		return "iSCSI transport module not loaded"
	case ISCSI_ERR_SESS_EXISTS:
		return "session already logged in"
	case ISCSI_ERR_ISCSID_COMM_ERR, ISCSI_ERR_ISCSID_NOTCONN:
		return "iscsid is not running or not reachable"
	case ISCSI_ERR_FATAL_LOGIN:
		return "the target refused the login"
	case ISCSI_ERR_NO_OBJS_FOUND:
		return "no matching record or session"
	case ISCSI_ERR_LOGIN_AUTH_FAILED:
		return "CHAP authentication failed"
	case ISCSI_ERR_BUSY:
		return "busy"
	case ISCSI_ERR_TRANS:
		return "transport error"
	case ISCSI_ERR_INVAL:
		return "invalid argument"
	case ISCSI_ERR_ACCESS:
		return "permission denied"
	case ISCSI_ERR_AGAIN:
		return "temporary failure, a retry may succeed"
	}
	return ""
}

// sentinelForExit maps an iscsiadm exit code to the errdefs sentinel the
// agent turns into a gRPC code.
func sentinelForExit(code int) error {
	switch code {
	case ISCSI_ERR_LOGIN_AUTH_FAILED:
		return errdefs.ErrPermissionDenied
	case ISCSI_ERR_ACCESS:
		return errdefs.ErrPermissionDenied
	case ISCSI_ERR_ISCSID_NOTCONN, ISCSI_ERR_ISCSID_COMM_ERR, ISCSI_ERR_TRANS_NOT_FOUND,
		ISCSI_ERR_TRANS_TIMEOUT, ISCSI_ERR_PDU_TIMEOUT, ISCSI_ERR_TRANS, ISCSI_ERR_AGAIN, ISCSI_ERR_LOGIN:
		return errdefs.ErrUnavailable
	case ISCSI_ERR_FATAL_LOGIN:
		// The target answered and refused (no such target, ACL): retrying
		// will not help until the target or the volume is fixed.
		return errdefs.ErrFailedPrecondition
	case ISCSI_ERR_NO_OBJS_FOUND, ISCSI_ERR_SESS_NOT_FOUND:
		return errdefs.ErrNotFound
	case ISCSI_ERR_SESS_EXISTS:
		return errdefs.ErrAlreadyExists
	case ISCSI_ERR_INVAL:
		return errdefs.ErrInvalidArgument
	case ISCSI_ERR_BUSY:
		return errdefs.ErrBusy
	}
	return nil
}
